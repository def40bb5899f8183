"""The load gate (``load_benefit``) on a real pair: whatever it chooses, every answer equals the
producer's own, and its choices account for every held token (loaded or computed).

It runs on the run's shared default pair (tests/vllm/default_pair.py), whose decode turns its
gate on for the requests it looks up while hook file ``load_benefit`` is there (the connector
reads it at each lookup; without PDXFER_TEST_HOOKS_DIR only the config turns it on). Counters
are compared with a snapshot taken before this test's requests: the shared pair served others.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import ask, check_logprobs, metrics, poll_metrics, prompt_of, through_pair

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
DECIDED = ("vllm:pdxfer_load_benefit_loads_total", "vllm:pdxfer_load_benefit_partials_total",
           "vllm:pdxfer_load_benefit_recomputes_total")
DECLINED = "vllm:pdxfer_load_benefit_declined_tokens_total"
LOADED = "vllm:pdxfer_tokens_loaded_total"


@pytest.fixture
def pair(default_pair):
    default_pair.set_hook("load_benefit", 1)
    try:
        yield default_pair
    finally:
        default_pair.set_hook("load_benefit", None)


def _moved(before: dict[str, float], after: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def test_gated_loads_answer_like_plain_and_account_for_every_held_token(pair):
    lengths = (300, 700, 1300, 2200, 520, 900)
    before = metrics(pair.decode_port)
    for i, n in enumerate(lengths):
        prompt = prompt_of(n, seed=9100 + i)
        ref = ask(pair.prefill_port, prompt, MAX_TOKENS)
        check_logprobs(through_pair(pair, prompt, MAX_TOKENS), ref)
    # Every prompt token but the last was held (the prefill published each prompt whole), and
    # each of the 6 requests was decided once: its held tokens were either loaded or declined
    # by the gate and computed. Stats reach /metrics a step after the request and a load's
    # tokens when it concludes: wait (bounded) for what the work determines, then compare.
    held = sum(n - 1 for n in lengths)
    m = poll_metrics(pair.decode_port, lambda m: sum(_moved(before, m, DECIDED).values()) >= len(lengths)
                     and sum(_moved(before, m, (LOADED, DECLINED)).values()) >= held)
    decided, split = _moved(before, m, DECIDED), _moved(before, m, (LOADED, DECLINED))
    print("load gate:", {k.split("_")[-2]: v for k, v in decided.items()}, "split", split)  # for -rA
    assert sum(decided.values()) == len(lengths), decided
    assert split[LOADED] + split[DECLINED] == held, split
