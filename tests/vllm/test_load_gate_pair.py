"""The load gate (``load_benefit``) on a real pair: whatever it chooses, every answer equals the
producer's own, and its choices account for every held token (loaded or computed)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import ask, check_logprobs, make_pair, metrics, prompt_of, through_pair, wait_metric

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", extra_cfg={"load_benefit": True})


def test_gated_loads_answer_like_plain_and_account_for_every_held_token(pair):
    lengths = (300, 700, 1300, 2200, 520, 900)
    for i, n in enumerate(lengths):
        prompt = prompt_of(n, seed=9100 + i)
        ref = ask(pair.prefill_port, prompt, MAX_TOKENS)
        check_logprobs(through_pair(pair, prompt, MAX_TOKENS), ref)
    decided = ("vllm:pdxfer_load_benefit_loads_total", "vllm:pdxfer_load_benefit_partials_total",
               "vllm:pdxfer_load_benefit_recomputes_total")
    # Stats reach /metrics one engine step after the request: poll (bounded).
    wait_metric(pair.decode_port, decided[0], 1)
    m = metrics(pair.decode_port)
    print("load gate:", {k.split("_")[-2]: m.get(k) for k in decided},
          "declined", m.get("vllm:pdxfer_load_benefit_declined_tokens_total"))  # for -rA
    assert sum(m.get(k, 0.0) for k in decided) == len(lengths), m
    # Every prompt token but the last was held (the prefill published each prompt whole): each
    # was either loaded or declined by the gate and computed.
    held = sum(n - 1 for n in lengths)
    assert m["vllm:pdxfer_tokens_loaded_total"] + m["vllm:pdxfer_load_benefit_declined_tokens_total"] == held, m
