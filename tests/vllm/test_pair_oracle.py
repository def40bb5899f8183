"""The pair oracle's logprob comparison (tests/vllm/conftest.check_logprobs) on made-up answers:
what it must let through (float32 noise, a near-tie at the k-th place) and what it must not."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import LOGPROB_TOL, Answer, OracleMismatch, check_logprobs


def _answer(tops: list[dict[str, float]]) -> Answer:
    tokens = [max(t, key=t.get) for t in tops]
    return Answer("".join(tokens), tokens, tops, None, "r")


REF = _answer([{"a": -0.1, "b": -2.5, "c": -3.0, "d": -4.0, "e": -5.0},
               {"x": -0.3, "y": -1.5, "z": -2.0, "w": -6.0, "v": -6.5}])


def test_float32_noise_passes_and_reports_the_largest_difference():
    noisy = _answer([{k: v + 2e-6 for k, v in t.items()} for t in REF.top])
    assert check_logprobs(noisy, REF) == pytest.approx(2e-6, abs=1e-9)


def test_a_near_tie_at_the_kth_place_passes():
    tops = [dict(t) for t in REF.top]
    del tops[1]["v"]
    tops[1]["u"] = -6.5 + LOGPROB_TOL / 2  # just in, where "v" was just out
    check_logprobs(_answer(tops), REF)


def test_a_moved_logprob_fails_on_logprobs():
    tops = [dict(t) for t in REF.top]
    tops[1]["z"] -= 0.01
    with pytest.raises(OracleMismatch) as caught:
        check_logprobs(_answer(tops), REF)
    assert caught.value.what == "logprobs" and "generated token 1" in str(caught.value)


def test_a_token_far_into_the_top_k_that_plain_does_not_rank_fails():
    tops = [dict(t) for t in REF.top]
    del tops[0]["e"]
    tops[0]["q"] = -1.0
    with pytest.raises(OracleMismatch, match="logprobs"):
        check_logprobs(_answer(tops), REF)


def test_another_greedy_token_fails_on_text():
    # Same logprobs, another token taken (e.g. a near-tie that went the other way): beyond it the
    # two continuations cannot be compared.
    flipped = Answer("bx", ["b", "x"], [dict(t) for t in REF.top], None, "r")
    with pytest.raises(OracleMismatch) as caught:
        check_logprobs(flipped, REF)
    assert caught.value.what == "text" and "generated token 0" in str(caught.value)


def test_a_reference_without_logprobs_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="no logprobs"):
        check_logprobs(REF, Answer("ab", ["a", "b"], [], None, "r"))


def test_an_answer_without_logprobs_fails():
    with pytest.raises(OracleMismatch, match="logprobs for 0 of 2"):
        check_logprobs(Answer("ax", ["a", "x"], [], None, "r"), REF)
