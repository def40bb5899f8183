"""The host-memory tier on a real pair: a prompt whose GPU blocks the prefill gave back (its
retention ran out, the master's entries moved to the prefill's host copy) is loaded by a decode
from that host copy, and the decode answers exactly as the prefill computing the prompt itself.
The prefill's KV cache is small (24 blocks of 128 tokens, a held-blocks cap of 12): a working set
several times larger keeps every computed chunk, each held over the cap only until its host copy
is made.

NIXL only: a TCP holder serving reads from its host tier is tested by test_host_tier_read.py (a
real TCP holder process with pdxfer's HostPool, read by the connector's halves).

Every count is the change since a snapshot taken just before the case, checked exactly: what the
prefill copied, moved and released, what it still holds on the device (nothing), and what the
decode loaded (every prompt token but the last, all of it from the host tier).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from pdxfer.master import MasterClient
from tests.vllm.conftest import ask, assert_decode_right, make_pair, metrics, prompt_of, wait_metric

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
RETENTION_S = 2.0
CHUNK_TOKENS = 256  # the pairs' chunk size (connector default)
# Counters and gauges reach /metrics with an engine step, so the prefill is given steps by a
# one-token request of this prompt. Once its one chunk (a tail) is host-only, computing it
# again publishes nothing (the host copy is refreshed in the host LRU), so it moves no count.
POKE = prompt_of(8, seed=7699)
P = "vllm:pdxfer_"
PREFILL_BLOCKS = 24  # of 128 tokens: the held-blocks cap (max_held_fraction 0.5) is 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "nixl",
                         prefill_args=("--num-gpu-blocks-override", str(PREFILL_BLOCKS), "--max-model-len", "2560"),
                         # A lease far longer than the stop below: only a deregistration ends it.
                         extra_cfg={"host_tier_mib": 64, "retention_s": RETENTION_S, "lease_ttl_s": 30.0})


def _poke(pair) -> dict[str, float]:
    ask(pair.prefill_port, POKE, 1)
    return metrics(pair.prefill_port)


def _settled(m: dict[str, float]) -> bool:
    """Nothing held on the device: every chunk published so far (POKE's at least) was copied to
    the host and moved there."""
    n = m.get(f"{P}offloads_queued_total", 0.0)
    return (n >= 1 and m.get(f"{P}held_chunks", 0.0) == 0 and m.get(f"{P}held_blocks", 0.0) == 0
            and m.get(f"{P}offloads_completed_total", 0.0) == n and m.get(f"{P}host_moves_total", 0.0) == n)


def _settled_prefill(pair, timeout: float = 30.0) -> dict[str, float]:
    """The prefill's counters once it holds nothing on the device (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _poke(pair)
        if _settled(m):
            return m
        assert time.monotonic() < deadline, f"the prefill still holds chunks on the device: {m}"
        # POKE computed again while its chunk is still held extends that chunk's retention: poke
        # less often than the retention, or it never moves.
        time.sleep(RETENTION_S * 1.5)


def _prefill_after_moves(pair, moves: float, timeout: float = 20.0) -> dict[str, float]:
    """The prefill's counters once ``moves`` chunks in all moved to its host tier (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _poke(pair)
        if m.get(f"{P}host_moves_total", 0.0) >= moves or time.monotonic() > deadline:
            return m
        time.sleep(0.3)


def _kv_cache_usage(port: int) -> float:
    """vLLM's own share of KV cache blocks in use (not free for new requests)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    assert len(found) == 1, f"expected one vllm:kv_cache_usage_perc series, got {found}"
    return float(found[0])


@pytest.mark.parametrize("n_tokens", [1300, 2200])
def test_a_prompt_released_from_the_gpu_is_loaded_from_the_host_tier(pair, n_tokens):
    prompt = prompt_of(n_tokens, seed=7700 + n_tokens)
    p0 = _settled_prefill(pair)
    d0 = metrics(pair.decode_port)
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)  # the producer alone
    ask(pair.prefill_port, prompt, 1)  # as a proxy's prefill step: publishes the prompt, tail included
    # New chunks: the full ones, the reference's tail (prompt + 7 generated tokens, still inside
    # the last chunk) and the prefill step's tail (the prompt's own); the full chunks were only
    # refreshed by the second request.
    new = n_tokens // CHUNK_TOKENS + 2
    m = _prefill_after_moves(pair, p0.get(f"{P}host_moves_total", 0.0) + new)

    def grew(name: str) -> float:
        return m.get(f"{P}{name}", 0.0) - p0.get(f"{P}{name}", 0.0)

    # Each new chunk was copied to host slots (timed from queueing to every rank's answer), then
    # moved there, its GPU blocks released: the prefill holds nothing on the device any more.
    for name in ("offloads_queued_total", "offloads_completed_total", "offload_seconds_count",
                 "host_moves_total", "freed_chunks_total", "host_chunks"):
        assert grew(name) == new, (name, grew(name), new, m)
    assert grew("offload_seconds_sum") > 0 and grew("offloads_failed_total") == 0, m
    assert grew("host_evictions_total") == 0, m
    assert m.get(f"{P}held_chunks", -1.0) == 0 and m.get(f"{P}held_blocks", -1.0) == 0, m
    # vLLM's own count: every KV cache block is free again (released blocks go back to its pool
    # at the scheduler's next call, and the usage reaches /metrics with a step: poll, bounded).
    deadline = time.monotonic() + 10.0
    while (usage := _kv_cache_usage(pair.prefill_port)) != 0.0 and time.monotonic() < deadline:
        _poke(pair)
        time.sleep(0.2)
    assert usage == 0.0, f"the prefill's KV cache is {usage:.2%} in use with nothing running or held"
    # The decode has never seen the prompt, and the prefill no longer holds its GPU blocks for
    # readers: every prompt token but the last must come from the prefill's host copy.
    got = ask(pair.decode_port, prompt, MAX_TOKENS)
    assert_decode_right(pair, got, ref, loaded=n_tokens - 1)
    host_loaded = f"{P}host_tier_tokens_loaded_total"
    wait_metric(pair.decode_port, host_loaded, d0.get(host_loaded, 0.0) + n_tokens - 1)
    d = metrics(pair.decode_port)
    # The hit funnel saw the prompt at every stage (exists, visible, selected), and all of the
    # load came from the host tier.
    for name in ("host_tier_tokens_loaded", "tokens_loaded", "hit_exists_tokens", "hit_visible_tokens",
                 "lookup_hit_tokens"):
        key = f"{P}{name}_total"
        assert d.get(key, 0.0) - d0.get(key, 0.0) == n_tokens - 1, (name, d, d0)


def test_a_working_set_far_larger_than_the_kv_cache_keeps_every_computed_chunk(pair):
    """Issue 40: eight prompts of 777-1,300 tokens (35 chunks) prefilled one after another into
    24 blocks. Before, a request's chunks beyond the cap were dropped while the previous request's
    chunks waited to move to the host: 4 of 8 prompts then loaded only their first 512 tokens."""
    lens = [777, 1300, 900, 1100, 1000, 1250, 800, 1200]
    prompts = [prompt_of(n, seed=7800 + i) for i, n in enumerate(lens)]
    p0 = _settled_prefill(pair)
    for p in prompts:  # as a proxy's prefill steps, one after another
        ask(pair.prefill_port, p, 1, prefill_step=True)
    answers = [ask(pair.decode_port, p, 1) for p in prompts]
    for p, got in zip(prompts, answers):
        # The producer alone, asked only now: its own answers must not publish anything first.
        assert_decode_right(pair, got, ask(pair.prefill_port, p, 1), loaded=len(p) - 1)
    m = metrics(pair.prefill_port)
    assert m.get(f"{P}chunks_over_cap_total", 0.0) == p0.get(f"{P}chunks_over_cap_total", 0.0), m
    assert m.get(f"{P}held_blocks", 99.0) <= 12, m  # back under the cap: the rest moved to host memory


def test_a_stopped_prefill_unpublishes_its_chunks_before_it_exits(pair):
    """Last in this module (it stops the prefill). vLLM stops with --shutdown-timeout (pdxfer's
    launch default): SIGTERM finishes what is in flight and stops the engine cleanly, so the
    connector deregisters and the master serves none of its chunks the moment it is gone (with
    vLLM's default, 0, the engine was killed at once and its chunks stayed served until the
    lease ended: measured 8 s and more with a 30 s lease)."""
    def master_now() -> dict:
        with MasterClient(pair.master_addr, timeout_s=5.0) as c:
            return c.stats()

    before = master_now()
    assert before["nodes"] == 1 and before["entries"] > 0, before  # the prefill, holding chunks
    t0 = time.monotonic()
    pair.prefill.stop(40)
    after = master_now()
    assert after["nodes"] == 0 and after["entries"] == 0, f"the stopped prefill is still served: {after}"
    assert after["nodes_expired"] == before["nodes_expired"]  # deregistered, not expired
    assert time.monotonic() - t0 < 30  # well inside the 30 s lease
    assert "stopping: deregistering from the master" in pair.prefill.log_path.read_text(errors="replace")
