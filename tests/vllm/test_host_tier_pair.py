"""The host-memory tier on a real pair: a prompt whose GPU blocks the prefill gave back (its
retention ran out, the master's entries moved to the prefill's host copy) is loaded by a decode
from that host copy, and the decode answers exactly as the prefill computing the prompt itself."""

from __future__ import annotations

import time

import pytest

from tests.vllm.conftest import ask, assert_decode_right, make_pair, metrics, prompt_of

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
RETENTION_S = 2.0
CHUNK_TOKENS = 256  # the pairs' chunk size (connector default)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request, tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, request.param,
                         extra_cfg={"host_tier_mib": 64, "retention_s": RETENTION_S})


def _prefill_metrics_after_moves(pair, moves: float, timeout: float = 20.0) -> dict[str, float]:
    """The prefill's counters once ``moves`` chunks moved to its host tier. Counters reach
    /metrics with engine steps: a one-token request gives it one (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        ask(pair.prefill_port, prompt_of(8, seed=int(time.monotonic() * 1000) % 100000), 1)
        m = metrics(pair.prefill_port)
        if m.get("vllm:pdxfer_host_moves_total", 0.0) >= moves or time.monotonic() > deadline:
            return m
        time.sleep(0.3)


@pytest.mark.parametrize("n_tokens", [1300, 2200])
def test_a_prompt_released_from_the_gpu_is_loaded_from_the_host_tier(pair, n_tokens):
    prompt = prompt_of(n_tokens, seed=7700 + n_tokens)
    before = metrics(pair.prefill_port).get("vllm:pdxfer_host_moves_total", 0.0)
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)  # the producer alone
    ask(pair.prefill_port, prompt, 1)  # as a proxy's prefill step: publishes the prompt, tail included
    chunks = -(-n_tokens // CHUNK_TOKENS)  # full chunks and the tail
    time.sleep(RETENTION_S)
    m = _prefill_metrics_after_moves(pair, before + chunks)
    assert m.get("vllm:pdxfer_host_moves_total", 0.0) - before >= chunks, m
    # Each copy was timed from its queueing to every rank's answer.
    assert m.get("vllm:pdxfer_offload_seconds_count", 0.0) >= chunks and m["vllm:pdxfer_offload_seconds_sum"] > 0, m
    # The decode has never seen the prompt, and the prefill no longer holds its GPU blocks for
    # readers: every prompt token but the last must come from the prefill's host copy.
    got = ask(pair.decode_port, prompt, MAX_TOKENS)
    assert_decode_right(pair, got, ref, loaded=n_tokens - 1)
    d = metrics(pair.decode_port)
    assert d.get("vllm:pdxfer_host_tier_tokens_loaded_total", 0.0) >= n_tokens - 1, d
    # The hit funnel saw the prompt at every stage (exists, visible, selected; loaded above).
    for stage in ("hit_exists_tokens", "hit_visible_tokens", "lookup_hit_tokens"):
        assert d.get(f"vllm:pdxfer_{stage}_total", 0.0) >= n_tokens - 1, (stage, d)
