"""Real prefill -> decode through pdxfer over the NIXL (UCX) transport: same output as the
instance computing everything, and the decode really read the prefix. The fault paths are
transport-independent (scheduler/worker logic) and covered over TCP in test_pd_tcp.py, except
a dead NIXL holder, which is checked here last.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12")

from tests.vllm.conftest import (  # noqa: E402
    ask, assert_oracle_catches_corruption, check_logprobs, make_pair, pair_oracle, prompt_of, queue_wait,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

MAX_TOKENS = 12
# The pair's settings (conftest PDPair.start) that bound the dead holder's cost.
LOOKUP_S = 0.5  # lookup_timeout_s (default)
LOAD_TIMEOUT_S = 5.0  # load_timeout_s: no read waits longer than this (read bound capped by it)
SLACK_S = 3.0  # a step that polls late on two shared busy cores; far below any unbounded wait


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "nixl")


@pytest.mark.parametrize("n_tokens", [700, 2200], ids=["3-chunks", "8-chunks"])
def test_decode_output_equals_plain_and_skips_the_prefix(pair, n_tokens):
    # The pair oracle (conftest): logprobs equal the producer's own, every token but the last loaded.
    pair_oracle(pair, prompt_of(n_tokens, seed=100 + n_tokens), MAX_TOKENS)


def test_the_oracle_catches_corrupted_loads(pair):
    assert_oracle_catches_corruption(pair, 700, seed=3300, max_tokens=MAX_TOKENS)


def test_dead_nixl_holder_means_recompute(pair):
    prompt = prompt_of(1000, seed=200)
    published = pair.published_at_master()
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)
    assert pair.wait_published(published + 4) >= published + 4  # 3 chunks and the tail, at the master
    pair.prefill.kill()
    waited, got = queue_wait(pair.decode_port, lambda: ask(pair.decode_port, prompt, MAX_TOKENS))
    check_logprobs(got, ref)
    own = pair.request_loads(got.request_id, until=lambda x: bool(x.loaded or x.failed))
    assert own.failed and not own.loaded, f"the dead holder met no read: {own}"
    # UCX reports the dead peer within the read's bound (read_timeout_floor_s 0.5 s plus its
    # bytes, never more than load_timeout_s): vLLM's queue time of the request, which ends where
    # its recompute starts, holds its lookup and that failed load.
    bound = LOOKUP_S + LOAD_TIMEOUT_S + SLACK_S
    print(f"dead NIXL holder: waited {waited:.2f} s; {own.reasons}")  # for -rA
    assert waited <= bound, f"vLLM kept the request waiting {waited:.2f} s against the dead holder (bound {bound} s)"
