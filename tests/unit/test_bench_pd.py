"""bench/pd.py's pure pieces: the interleaving order, the decode step and floor, and the rows that
turn raw samples into ratios (decode / floor, interleaved prefill / plain)."""

from __future__ import annotations

import pytest

from bench.pd_report import PLAIN_AFTER, length_rows, targets
from bench.pd_util import floor_ms, interleave_order, step_differences


def test_interleave_order_is_abba_and_balanced():
    order = interleave_order("plain", "pdxfer", 4)
    assert order == ["plain", "pdxfer", "pdxfer", "plain", "plain", "pdxfer", "pdxfer", "plain"]
    # Each side goes first in half the rounds, so what one request leaves behind hits both alike.
    firsts = order[0::2]
    assert firsts.count("plain") == firsts.count("pdxfer") == 2
    # Under a linear drift (request i costs i), both sides' sums are equal over whole ABBA blocks.
    cost = {s: sum(i for i, x in enumerate(order) if x == s) for s in ("plain", "pdxfer")}
    assert cost["plain"] == cost["pdxfer"]


def test_interleave_order_odd_and_empty():
    assert interleave_order("a", "b", 3) == ["a", "b", "b", "a", "a", "b"]
    assert interleave_order("a", "b", 0) == []


@pytest.mark.parametrize("a, b, pairs, msg", [("a", "a", 2, "two different"), ("a", "b", -1, "pairs")])
def test_interleave_order_rejects_bad_input(a, b, pairs, msg):
    with pytest.raises(ValueError, match=msg):
        interleave_order(a, b, pairs)


def test_step_differences_pair_and_divide_by_steps():
    # The first step's noise (100 vs 140 ms) cancels within each pair.
    assert step_differences([100.0, 140.0], [110.0, 150.5], 1) == [10.0, 10.5]
    assert step_differences([100.0], [130.0], 3) == [10.0]


@pytest.mark.parametrize("one, more, steps, msg", [([1.0], [2.0, 3.0], 1, "unpaired"),
                                                   ([1.0], [2.0], 0, "steps")])
def test_step_differences_rejects_bad_input(one, more, steps, msg):
    with pytest.raises(ValueError, match=msg):
        step_differences(one, more, steps)


def test_floor_is_step_plus_http_without_counting_a_step_twice():
    # A one-token prompt's 12 ms hold HTTP and one (tiny) step of 2 ms: HTTP is 10 ms.
    assert floor_ms(7.0, 12.0, 2.0) == 17.0
    assert floor_ms(None, 12.0, 2.0) is None
    assert floor_ms(7.0, None, 2.0) is None


def _floor(steps: list[float], one: list[float]) -> dict:
    return {"steps": 1, "step_ms": steps, "max_tokens_1_ms": one, "max_tokens_more_ms": []}


def _phases() -> dict:
    return {
        "plain": {"per_len": {"300": {"samples": {"ttft": [60.0, 62.0]}}},
                  "floor": {"1": _floor([2.0, 2.0], [12.0, 12.0]), "300": _floor([6.0, 8.0], [70.0])}},
        PLAIN_AFTER: {"per_len": {"300": {"samples": {"ttft": [64.0, 66.0]}}},
                      "floor": {"1": _floor([2.0, 2.0], [12.0, 12.0]), "300": _floor([8.0, 8.0], [70.0])}},
        "pdxfer": {"per_len": {"300": {"samples": {"prefill": [63.0], "ttft": [36.0]}}}},
        "interleaved": {
            "per_len": {"300": {"samples": {"plain": [100.0, 104.0, 90.0], "prefill": [102.0, 103.0, 95.0],
                                            "ttft": [40.0, 42.0, 44.0]},
                                "idle_partner_cpu_ms": {"plain": [0.0, 1.0, 0.0], "pdxfer": [2.0, 2.0, 3.0]}}},
            "floor": {"1": _floor([3.0], [15.0]), "300": _floor([9.0], [80.0])}},
    }


def test_rows_report_decode_over_floor_and_interleaved_ratio():
    (r,) = length_rows(_phases(), [300])
    # Floor pools plain and plain_after: step median of [6, 8, 8, 8] = 8, HTTP 12 - 2 = 10.
    assert (r["decode_step_ms"], r["http_ms"], r["floor_ms"], r["floor_n"]) == (8.0, 10.0, 18.0, 4)
    assert r["pdxfer_decode_vs_floor"] == 2.0  # 36 / 18
    assert r["nixl_decode_vs_floor"] is None
    # The interleaved configuration's own floor: 9 + (15 - 3) = 21; decode median 42.
    assert r["interleaved_floor_ms"] == 21.0
    assert r["interleaved_decode_vs_floor"] == 2.0
    # Prefill / plain of medians 102 / 100 and of minimums 95 / 90.
    assert r["interleaved_prefill_vs_plain"] == 1.02
    assert r["interleaved_prefill_vs_plain_of_minimums"] == 1.056
    assert (r["interleaved_idle_cpu_ms_during_plain"], r["interleaved_idle_cpu_ms_during_pair"]) == (0.0, 2.0)
    # The existing fields keep their meaning: plain pools before and after.
    assert r["plain_ttft_ms"] == 63.0 and r["pdxfer_prefill_vs_plain"] == 1.0
    assert targets([r], {})["interleaved_prefill_within_1.03_of_plain_every_length"] is True


def test_interleaved_target_fails_above_1_03_and_is_unknown_without_data():
    ph = _phases()
    ph["interleaved"]["per_len"]["300"]["samples"]["prefill"] = [110.0, 111.0, 112.0]
    (r,) = length_rows(ph, [300])
    assert r["interleaved_prefill_vs_plain"] == 1.11
    assert targets([r], {})["interleaved_prefill_within_1.03_of_plain_every_length"] is False
    del ph["interleaved"]
    (r,) = length_rows(ph, [300])
    assert r["interleaved_prefill_vs_plain"] is None and r["interleaved_floor_ms"] is None
    assert targets([r], {})["interleaved_prefill_within_1.03_of_plain_every_length"] is None
