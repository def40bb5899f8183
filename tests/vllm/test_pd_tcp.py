"""Real prefill -> decode through pdxfer over the TCP transport, and the faults that must end in
recompute (same output, no hang). One pair for the module; tests run in file order and the two
that kill processes come last.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.conftest import CHUNK, complete, make_pair, metrics, post_json, prompt_of, wait_metric

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "tcp")


def _through_pair(pair, prompt: list[int]) -> str:
    complete(pair.prefill_port, prompt, 1)
    return complete(pair.decode_port, prompt, MAX_TOKENS)


@pytest.mark.parametrize("n_tokens", [100, 640, 700, 768, 2200],
                         ids=["under-a-chunk", "block-boundary", "mid-chunk", "chunk-boundary", "8-chunks"])
def test_decode_output_equals_plain_and_skips_the_prefix(pair, n_tokens):
    prompt = prompt_of(n_tokens, seed=n_tokens)
    # Reference: the producer instance computing everything itself (kv_producer never loads).
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    before = pair.loaded_tokens()
    out = _through_pair(pair, prompt)
    assert out == ref
    expected = n_tokens - 1  # every prompt token but the last (issue 12: the tail moves too)
    got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + expected) - before
    assert got == expected


def test_second_decode_reuses_held_chunks(pair):
    prompt = prompt_of(1300, seed=11)
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    assert _through_pair(pair, prompt) == ref
    # Empty the decode's local prefix cache; the prefill is not asked again: the chunks it still
    # holds serve a second reader.
    post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
    before = pair.loaded_tokens()
    assert complete(pair.decode_port, prompt, MAX_TOKENS) == ref
    got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + 1299) - before
    assert got == 1299  # the 5 full chunks and the tail the prefill still holds


def test_a_decode_waits_for_a_publish_still_on_its_way(pair):
    """Issue 12: the prefill answers without waiting for its publish; its kv_transfer_params
    (forwarded like a proxy does) make the decode wait for the chunks (vLLM asks the connector
    again each step while it answers None) instead of recomputing them."""
    prompt = prompt_of(700, seed=77)
    waits = metrics(pair.decode_port).get("vllm:pdxfer_publish_hint_waits_total", 0.0)
    before = pair.loaded_tokens()
    pair.set_hook("publish_delay_s", 0.5)
    try:
        complete(pair.prefill_port, prompt, 1)
        out = complete(pair.decode_port, prompt, MAX_TOKENS)
    finally:
        pair.set_hook("publish_delay_s", None)
    got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + 699) - before
    assert got == 699  # every token but the last, though the lookup came before the publish
    assert metrics(pair.decode_port).get("vllm:pdxfer_publish_hint_waits_total", 0.0) >= waits + 1
    assert out == complete(pair.prefill_port, prompt, MAX_TOKENS)


def test_concurrent_requests_sharing_prefixes_answer_like_plain(pair):
    """Issue 9, hole 0: 16 requests at once, 4 prefixes of 1024 tokens x 4 suffixes of 200, each
    through prefill then decode as the proxy does. Every answer equals the producer's own answer
    computed alone afterwards, and the decode loaded the shared prefixes instead of computing them."""
    prefixes = [prompt_of(1024, 500 + i) for i in range(4)]
    prompts = [p + prompt_of(200, 600 + 10 * i + j) for i, p in enumerate(prefixes) for j in range(4)]
    failed, before = pair.failed_loads(), pair.loaded_tokens()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _through_pair(pair, p), prompts))
    refs = [complete(pair.prefill_port, p, MAX_TOKENS) for p in prompts]
    wrong = [i for i, (a, r) in enumerate(zip(answers, refs)) if a != r]
    assert not wrong, f"answers {wrong} differ from the producer's own"
    assert pair.failed_loads() == failed
    # Each prefix reaches the decode at least once as a load (later siblings may hit its local cache).
    assert wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + 4 * 4 * CHUNK) \
        >= before + 4 * 4 * CHUNK


def test_frozen_prefill_costs_at_most_a_recompute_and_a_second(pair):
    """Issue 12: a holder that stops answering (SIGSTOP) while the decode reads its chunks costs
    the read's small bound, not a fixed 10 s: TTFT stays within recompute + 1 s, same answer."""
    # The decode has read from this holder before (the connection is up): the holder freezes
    # while the decode needs its chunks. (A holder frozen at first contact costs connect_timeout_s.)
    warm = prompt_of(300, seed=18)
    complete(pair.prefill_port, warm, 1)
    complete(pair.decode_port, warm, 1)
    prompt = prompt_of(1500, seed=16)
    published = pair.published_at_master()
    first = complete(pair.prefill_port, prompt, 1)  # computed, published, held
    assert pair.wait_published(published + 6) >= published + 6  # 5 chunks and the tail
    fresh = prompt_of(1500, seed=17)  # nobody holds it: the decode computes it all
    t0 = time.monotonic()
    complete(pair.decode_port, fresh, 1)
    recompute = time.monotonic() - t0
    os.killpg(pair.prefill.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = complete(pair.decode_port, prompt, 1)
        took = time.monotonic() - t0
    finally:
        os.killpg(pair.prefill.pid, signal.SIGCONT)
    assert out == first
    assert took < recompute + 1.0, f"TTFT {took:.2f} s with the holder frozen; recompute {recompute:.2f} s"


def test_answers_stay_right_under_concurrent_load_with_faults(pair):
    """Issue 9: the pair under concurrent load while the prefill is frozen, the master restarts,
    and locks expire mid-read. Every answer equals the producer's own, computed alone afterwards."""
    prefixes = [prompt_of(700, 800 + i) for i in range(3)]
    waves = [[p + prompt_of(150, 900 + 10 * w + j) for p in prefixes for j in range(3)] for w in range(3)]

    def freeze_prefill() -> None:
        time.sleep(0.3)
        os.killpg(pair.prefill.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.killpg(pair.prefill.pid, signal.SIGCONT)

    def restart_master() -> None:
        time.sleep(0.3)
        pair.master.kill()
        time.sleep(1.0)
        pair.start_master()

    def expire_locks() -> None:
        pair.set_hook("lock_ttl_s", 0.5)
        pair.set_hook("read_delay_s", 1.0)
        time.sleep(3.0)
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)

    answers: list[str] = []
    try:
        for prompts, fault in zip(waves, (freeze_prefill, restart_master, expire_locks)):
            with ThreadPoolExecutor(len(prompts) + 1) as pool:
                injected = pool.submit(fault)
                answers += list(pool.map(lambda p: _through_pair(pair, p), prompts))
                injected.result(timeout=30)
    finally:
        os.killpg(pair.prefill.pid, signal.SIGCONT)
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)
    refs = [complete(pair.prefill_port, p, MAX_TOKENS) for w in waves for p in w]
    wrong = [i for i, (a, r) in enumerate(zip(answers, refs)) if a != r]
    assert not wrong, f"answers {wrong} differ from the producer's own"


def test_lock_expired_mid_read_recomputes(pair):
    prompt = prompt_of(900, seed=12)
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    complete(pair.prefill_port, prompt, 1)
    failed = pair.failed_loads()
    pair.set_hook("lock_ttl_s", 0.5)
    pair.set_hook("read_delay_s", 1.5)
    try:
        assert complete(pair.decode_port, prompt, MAX_TOKENS) == ref
    finally:
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)
    assert wait_metric(pair.decode_port, "vllm:pdxfer_loads_failed_total", failed + 1) == failed + 1


def test_master_killed_requests_recompute_then_recover(pair):
    prompt = prompt_of(1100, seed=13)
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    pair.master.kill()
    before = pair.loaded_tokens()
    t0 = time.monotonic()
    assert _through_pair(pair, prompt) == ref
    assert time.monotonic() - t0 < 60
    assert pair.loaded_tokens() == before  # nothing could be looked up: all recomputed
    # A new master on the same address: the holder re-registers and re-publishes what it holds.
    pair.start_master()
    prompt2 = prompt_of(1100, seed=14)
    ref2 = complete(pair.prefill_port, prompt2, MAX_TOKENS)
    deadline = time.monotonic() + 30
    while True:  # the decode backs off after master errors; the prefill re-registers on its lease
        complete(pair.prefill_port, prompt2, 1)  # (re)publish once the node is known again
        before = pair.loaded_tokens()
        post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
        out = complete(pair.decode_port, prompt2, MAX_TOKENS)
        assert out == ref2
        if wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + 4 * CHUNK, 3) > before:
            break
        assert time.monotonic() < deadline, "transfers never resumed after the master came back"
        time.sleep(1)


def test_prefill_killed_after_publishing_decode_recomputes(pair):
    prompt = prompt_of(1500, seed=15)
    published = pair.published_at_master()
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)  # computed and published by the prefill
    # More prompts sharing its first chunks, for a concurrent load onto the dead holder.
    others = [prompt[:600] + prompt_of(300, 150 + i) for i in range(6)]
    refs = [complete(pair.prefill_port, p, MAX_TOKENS) for p in others]
    pair.wait_published(published + 6 + 6 * 2)  # 5 chunks + tail; 1 new chunk + tail each
    failed = pair.failed_loads()
    pair.prefill.kill()
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(others) + 1) as pool:
        answers = list(pool.map(lambda p: complete(pair.decode_port, p, MAX_TOKENS), [prompt] + others))
    assert answers == [ref] + refs
    assert time.monotonic() - t0 < 30
    # The master still listed the dead holder (lease not yet expired): reads failed -> recompute
    # (one per request that looked up before a sibling's recompute filled the local prefix cache).
    assert failed + 1 <= wait_metric(pair.decode_port, "vllm:pdxfer_loads_failed_total", failed + 1) <= failed + 7

