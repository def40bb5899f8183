"""Real prefill -> decode through pdxfer over the TCP transport, and the faults that must end in
recompute (same output, no hang). The tests run on the run's shared default pair
(tests/vllm/default_pair.py): other modules' tests may run on it before these, so every counter
is compared with a snapshot taken before the test's own work; a test that kills the master
starts it again, and the one that kills the prefill runs last. Every answer is checked by the
pair oracle (conftest): top-k logprobs against the producer computing the prompt itself, and
each request's own load. A fault's cost is bounded by the pair's configured timeouts plus slack,
measured where the connector waits (its log, vLLM's queue time of the request), never against
another request's timing.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.conftest import (
    Answer, ask, assert_decode_right, assert_oracle_catches_corruption, check_logprobs, metrics, pair_oracle,
    post_json, prompt_of, queue_wait, through_pair, wait_metrics,
)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
# The pair's settings (conftest PDPair.start) that bound the waits below.
HINT_WAIT_S = 3.0  # publish_hint_wait_s
LOOKUP_S = 0.5  # lookup_timeout_s (default)
CONNECT_S = 1.0  # connect_timeout_s (default)
LOAD_TIMEOUT_S = 5.0  # load_timeout_s: no read waits longer than this (read bound capped by it)
SLACK_S = 3.0  # a step that polls late on two shared busy cores; far below any unbounded wait
_PENDING = re.compile(r"read still pending after ([0-9.]+) s, past its bound")
_NO_CONNECTION = re.compile(r"no connection to the holder after ([0-9.]+) s")


@pytest.fixture
def pair(default_pair):
    return default_pair


@pytest.mark.parametrize("n_tokens", [100, 640, 700, 768, 2200],
                         ids=["under-a-chunk", "block-boundary", "mid-chunk", "chunk-boundary", "8-chunks"])
def test_decode_output_equals_plain_and_skips_the_prefix(pair, n_tokens):
    # Every prompt token but the last is loaded (issue 12: the tail moves too).
    pair_oracle(pair, prompt_of(n_tokens, seed=n_tokens), MAX_TOKENS)


def test_the_oracle_catches_corrupted_loads(pair):
    assert_oracle_catches_corruption(pair, 700, seed=3100, max_tokens=MAX_TOKENS)


def test_second_decode_reuses_held_chunks(pair):
    prompt = prompt_of(1300, seed=11)
    pair_oracle(pair, prompt, MAX_TOKENS)
    # Empty the decode's local prefix cache; the prefill is not asked again: the chunks it still
    # holds serve a second reader (the 5 full chunks and the tail).
    post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
    got = ask(pair.decode_port, prompt, MAX_TOKENS)
    assert_decode_right(pair, got, ask(pair.prefill_port, prompt, MAX_TOKENS), loaded=1299)


def test_metrics_show_what_the_pair_holds_and_looked_up(pair):
    """The held-blocks gauges and the lookup counters on both instances' /metrics, for this
    test's own work: a 1300-token prompt through the pair, then read again by the decode from
    the chunks the prefill still holds. Against a snapshot taken before: two loads of 1299
    tokens, each selected by a lookup, none failed; the prefill holds the prompt's 5 chunks and
    its tail (retention_s 60) under its cap."""
    prompt = prompt_of(1300, seed=4300)
    before = metrics(pair.decode_port)
    pair_oracle(pair, prompt, MAX_TOKENS)
    post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
    got = ask(pair.decode_port, prompt, MAX_TOKENS)
    assert_decode_right(pair, got, ask(pair.prefill_port, prompt, MAX_TOKENS), loaded=1299)
    want = {"vllm:pdxfer_loads_ok_total": 2, "vllm:pdxfer_tokens_loaded_total": 2 * 1299,
            "vllm:pdxfer_lookup_hit_tokens_total": 2 * 1299}
    after = wait_metrics(pair.decode_port, {k: before.get(k, 0.0) + v for k, v in want.items()})
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in (*want, "vllm:pdxfer_loads_failed_total", "vllm:pdxfer_lookups_total")}
    assert {k: moved[k] for k in want} == want and moved["vllm:pdxfer_loads_failed_total"] == 0, moved
    # One lookup per request at least; a request that waited for the hinted publish polled more.
    assert moved["vllm:pdxfer_lookups_total"] >= 2, moved

    def held() -> dict[str, float]:
        ask(pair.prefill_port, prompt_of(20, seed=4242), 1)  # a step, which carries the gauges
        return metrics(pair.prefill_port)

    deadline = time.monotonic() + 20
    m = held()
    while m.get("vllm:pdxfer_held_chunks", 0.0) < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
        m = held()
    # Every held chunk holds a block at least (a prompt's tail chunk may hold just one).
    assert 6 <= m.get("vllm:pdxfer_held_chunks", 0.0) <= m["vllm:pdxfer_held_blocks"] <= \
        m["vllm:pdxfer_held_blocks_cap"], m


def test_a_decode_waits_for_a_publish_still_on_its_way(pair):
    """Issue 12: the prefill answers without waiting for its publish; its kv_transfer_params
    (forwarded like a proxy does) make the decode wait for the chunks (vLLM asks the connector
    again each step while it answers None) instead of recomputing them."""
    prompt = prompt_of(700, seed=77)
    hint_waits = "vllm:pdxfer_publish_hint_waits_total"
    waits = metrics(pair.decode_port).get(hint_waits, 0.0)
    pair.set_hook("publish_delay_s", 0.5)
    try:
        ask(pair.prefill_port, prompt, 1)
        got = ask(pair.decode_port, prompt, MAX_TOKENS)
    finally:
        pair.set_hook("publish_delay_s", None)
    # Every token but the last, though the lookup came before the publish.
    assert_decode_right(pair, got, ask(pair.prefill_port, prompt, MAX_TOKENS), loaded=699)
    # This request waited once (a request never waits twice), and no other request ran there.
    after = wait_metrics(pair.decode_port, {hint_waits: waits + 1}).get(hint_waits, 0.0)
    assert after - waits == 1, f"{after - waits:.0f} publish-hint waits for one request"


def test_concurrent_requests_sharing_prefixes_answer_like_plain(pair):
    """Issue 9, hole 0: 16 requests at once, 4 prefixes of 1024 tokens x 4 suffixes of 200, each
    through prefill then decode as the proxy does. Every answer's logprobs equal the producer's
    own computed alone afterwards, and every request's own load brought what its prefill had and
    the decode's local prefix cache did not: all its prompt but the last token, in vLLM's count."""
    prefixes = [prompt_of(1024, 500 + i) for i in range(4)]
    prompts = [p + prompt_of(200, 600 + 10 * i + j) for i, p in enumerate(prefixes) for j in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: through_pair(pair, p, MAX_TOKENS), prompts))
    refs = [ask(pair.prefill_port, p, MAX_TOKENS) for p in prompts]
    for i, (a, r, p) in enumerate(zip(answers, refs, prompts)):
        check_logprobs(a, r)
        own = pair.request_loads(a.request_id, until=lambda x: bool(x.loaded or x.failed))
        assert not own.failed and len(own.loaded) == 1, f"request {i}: {own}"
        assert a.cached_tokens == len(p) - 1, f"request {i}: vLLM did not compute {a.cached_tokens} tokens"
        # The rest came from the local prefix cache, in whole blocks (128 tokens), after a sibling's load.
        local = len(p) - 1 - own.loaded[0]
        assert local >= 0 and local % 128 == 0, f"request {i}: loaded {own.loaded[0]} of {len(p) - 1}"


def test_frozen_prefill_costs_at_most_a_recompute_and_a_second(pair):
    """Issue 12: a holder that stops answering (SIGSTOP) while the decode reads its chunks costs
    the read's bound, then a recompute: same answer, the freeze met this request's read (its
    load failed, given up by the read's bound, which load_timeout_s caps), and vLLM kept the
    request waiting no longer than a lookup and that bound (its queue time; the recompute after
    it is not part of it)."""
    # The decode has read from this holder before (the connection is up): the holder freezes
    # while the decode needs its chunks. (A holder frozen at first contact costs connect_timeout_s.)
    warm = prompt_of(300, seed=18)
    ask(pair.prefill_port, warm, 1)
    ask(pair.decode_port, warm, 1)
    prompt = prompt_of(1500, seed=16)
    published = pair.published_at_master()
    first = ask(pair.prefill_port, prompt, 1)  # computed, published, held
    assert pair.wait_published(published + 6) >= published + 6  # 5 chunks and the tail
    os.killpg(pair.prefill.pid, signal.SIGSTOP)
    try:
        waited, got = queue_wait(pair.decode_port, lambda: ask(pair.decode_port, prompt, 1))
    finally:
        os.killpg(pair.prefill.pid, signal.SIGCONT)
    check_logprobs(got, first)
    own = pair.request_loads(got.request_id, until=lambda x: bool(x.loaded or x.failed))
    assert own.failed == [1499] and not own.loaded, f"the freeze did not meet the read: {own}"
    pending = _PENDING.match(own.reasons[0])
    assert pending, f"the frozen holder's read was not given up by its bound: {own.reasons}"
    assert float(pending.group(1)) <= LOAD_TIMEOUT_S + SLACK_S, own.reasons
    bound = LOOKUP_S + LOAD_TIMEOUT_S + SLACK_S
    assert waited <= bound, f"vLLM kept the request waiting {waited:.2f} s with the holder frozen (bound {bound} s)"


def _wait_loads_resume(pair, prompt: list[int], timeout_s: float = 20.0) -> None:
    """After a master restart: until a decode loads ``prompt`` again (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ask(pair.prefill_port, prompt, 1)  # (re)publish once the node is known again
        post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
        out = ask(pair.decode_port, prompt, 1)
        if pair.request_loads(out.request_id, until=lambda x: bool(x.loaded), timeout=1.0).loaded:
            return
        assert time.monotonic() < deadline, "transfers never resumed after the master came back"
        time.sleep(0.5)


def test_answers_stay_right_under_concurrent_load_with_faults(pair):
    """Issue 9: the pair under concurrent load while the prefill is frozen, the master restarts,
    and locks expire mid-read. Every answer's logprobs equal the producer's own, computed alone
    afterwards, and each fault met some request of its wave (a failed load, or for the master's
    restart a request that could not load)."""
    prefixes = [prompt_of(700, 800 + i) for i in range(3)]
    waves = [[p + prompt_of(150, 900 + 10 * w + j) for p in prefixes for j in range(3)] for w in range(3)]

    def concurrently(fn, prompts: list[list[int]], fault=None) -> list[Answer]:
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            injected = pool.submit(fault) if fault else None
            out = list(pool.map(fn, prompts))
            if injected:
                injected.result(timeout=15)  # each fault lasts 1.5-3 s after its start
        return out

    def thaw_later() -> None:
        time.sleep(1.5)
        os.killpg(pair.prefill.pid, signal.SIGCONT)

    def restart_master_later() -> None:
        # Past the decodes' bounded wait for their hinted publish (which would bridge a shorter
        # outage: the restarted master gets the holder's re-publish).
        time.sleep(HINT_WAIT_S + LOOKUP_S)
        pair.start_master()

    def expire_locks() -> None:
        pair.set_hook("lock_ttl_s", 0.5)
        pair.set_hook("read_delay_s", 1.0)
        time.sleep(3.0)
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)

    answers: list[list[Answer]] = []
    try:
        # Wave 0: the prompts are prefilled and published, then the prefill freezes while all
        # their decodes read from it at once (a freeze at a random moment may meet no read).
        published = pair.published_at_master()
        concurrently(lambda p: ask(pair.prefill_port, p, 1), waves[0])
        assert pair.wait_published(published + len(waves[0])) >= published + len(waves[0])
        os.killpg(pair.prefill.pid, signal.SIGSTOP)
        answers.append(concurrently(lambda p: ask(pair.decode_port, p, MAX_TOKENS), waves[0], thaw_later))
        # Wave 1: prefilled and published, then the master dies before the decodes look up and
        # comes back while they run (killed at a random moment, it may meet no lookup).
        published = pair.published_at_master()
        concurrently(lambda p: ask(pair.prefill_port, p, 1), waves[1])
        assert pair.wait_published(published + len(waves[1])) >= published + len(waves[1])
        pair.master.kill()
        answers.append(concurrently(lambda p: ask(pair.decode_port, p, MAX_TOKENS), waves[1], restart_master_later))
        # Wave 2 reads while the locks expire: first the holder must be known again and the
        # decode past its back-off after the master's errors, or nothing is read to meet it.
        _wait_loads_resume(pair, prompt_of(600, seed=950))
        answers.append(concurrently(lambda p: through_pair(pair, p, MAX_TOKENS), waves[2], expire_locks))
    finally:
        os.killpg(pair.prefill.pid, signal.SIGCONT)
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)
    met = []
    for w, (prompts, got) in enumerate(zip(waves, answers)):
        for a, p in zip(got, prompts):
            check_logprobs(a, ask(pair.prefill_port, p, MAX_TOKENS))
        loads = [pair.request_loads(a.request_id) for a in got]
        failed = [i for i, ld in enumerate(loads) if ld.failed]
        not_loaded = [i for i, (a, p) in enumerate(zip(got, prompts)) if (a.cached_tokens or 0) < len(p) - 1]
        met.append((failed + not_loaded if w == 1 else failed, loads))
    assert all(m for m, _ in met), f"a fault met no request's load: {met}"


def test_lock_expired_mid_read_recomputes(pair):
    prompt = prompt_of(900, seed=12)
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)
    ask(pair.prefill_port, prompt, 1)
    pair.set_hook("lock_ttl_s", 0.5)
    pair.set_hook("read_delay_s", 1.5)
    try:
        got = ask(pair.decode_port, prompt, MAX_TOKENS)
    finally:
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)
    check_logprobs(got, ref)
    own = pair.request_loads(got.request_id, until=lambda x: bool(x.loaded or x.failed))
    assert own.failed == [899] and not own.loaded, own


def test_master_killed_requests_recompute_then_recover(pair):
    prompt = prompt_of(1100, seed=13)
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)
    pair.master.kill()
    ask(pair.prefill_port, prompt, 1)
    # The decode waits at most the publish hint's bound for chunks the master cannot show, each
    # lookup bounded, then computes everything: vLLM's queue time of the request counts the
    # steps it waited through before its compute (conftest QUEUE_TIME).
    waited, got = queue_wait(pair.decode_port, lambda: ask(pair.decode_port, prompt, MAX_TOKENS))
    check_logprobs(got, ref)
    own = pair.request_loads(got.request_id)
    assert got.cached_tokens == 0 and not own.loaded and not own.failed, (got.cached_tokens, own)
    bound = HINT_WAIT_S + LOOKUP_S + SLACK_S
    assert waited <= bound, f"vLLM kept the request waiting {waited:.2f} s with the master dead (bound {bound} s)"
    # A new master on the same address: the holder re-registers and re-publishes what it holds.
    pair.start_master()
    prompt2 = prompt_of(1100, seed=14)
    ref2 = ask(pair.prefill_port, prompt2, MAX_TOKENS)
    # The prefill re-registers on its next heartbeat (lease_ttl_s 4 s), the decode backs off
    # after master errors: a few seconds.
    deadline = time.monotonic() + 20
    while True:
        ask(pair.prefill_port, prompt2, 1)  # (re)publish once the node is known again
        post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})
        out = ask(pair.decode_port, prompt2, MAX_TOKENS)
        check_logprobs(out, ref2)
        # While the master is still learning what the holder holds (its re-publish and this
        # prompt's publish race the lookup), a load may cover only the leading chunks: right,
        # but not yet recovered.
        if pair.request_loads(out.request_id, until=lambda x: bool(x.loaded), timeout=1.0).loaded == [1099]:
            assert_decode_right(pair, out, ref2, loaded=1099)
            break
        assert time.monotonic() < deadline, "transfers never resumed after the master came back"
        time.sleep(1)


@pytest.mark.default_pair_order("last")  # the pair has no prefill afterwards
def test_prefill_killed_after_publishing_decode_recomputes(pair):
    prompt = prompt_of(1500, seed=15)
    published = pair.published_at_master()
    ref = ask(pair.prefill_port, prompt, MAX_TOKENS)  # computed and published by the prefill
    # More prompts sharing its first chunks, for a concurrent load onto the dead holder.
    others = [prompt[:600] + prompt_of(300, 150 + i) for i in range(6)]
    refs = [ask(pair.prefill_port, p, MAX_TOKENS) for p in others]
    pair.wait_published(published + 6 + 6 * 2)  # 5 chunks + tail; 1 new chunk + tail each
    pair.prefill.kill()
    with ThreadPoolExecutor(len(others) + 1) as pool:
        answers = list(pool.map(lambda p: ask(pair.decode_port, p, MAX_TOKENS), [prompt] + others))
    for a, r in zip(answers, [ref] + refs):
        check_logprobs(a, r)
    # The master still listed the dead holder (lease not yet expired): reads failed -> recompute
    # (at least the first request's; nothing can have been loaded from a dead process).
    loads = [pair.request_loads(a.request_id, until=lambda x: bool(x.failed or x.loaded), timeout=1.0)
             for a in answers]
    assert any(ld.failed for ld in loads) and not any(ld.loaded for ld in loads), loads
    # A dead holder refuses the connection or resets it: each read failed at once, none waited
    # out its read bound, and a reconnection was given up within connect_timeout_s.
    for i, ld in enumerate(loads):
        for why in ld.reasons:
            assert not _PENDING.match(why), f"request {i}: a read from the dead holder waited out its bound: {why}"
            if m := _NO_CONNECTION.match(why):
                assert float(m.group(1)) <= CONNECT_S + SLACK_S, f"request {i}: {why}"
    print("dead holder, failed loads:", [ld.reasons for ld in loads])  # for -rA
