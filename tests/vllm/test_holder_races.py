"""Races in the real holder (pdxfer.vllm.scheduler.holder.HolderPath) between its publisher thread, its reaper
and a re-registration's re-publish, each replayed in one deterministic order against the real
scheduler half, vLLM's BlockPool and a real master.

The oracle is the one a reader cares about: every chunk the master serves for the holder is one the
holder still holds, on the blocks the master names. A chunk served from blocks given back to vLLM
hands a reader another request's KV under a valid lock (its release() says True).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")

from pdxfer.master import MasterError, PublishFenced  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.test_connector_flow import BS, C, Node, _tokens  # noqa: E402
from tests.vllm.test_connector_flow import frozen_master_pair, pair  # noqa: E402,F401  (fixtures)


def chunk_keys(node: Node, toks: list[int]) -> list[bytes]:
    return node.sched._new_hasher(None).update(list(toks))[: len(toks) // C]


def served_from_freed_blocks(holder: Node, keys: list[bytes]) -> list[str]:
    """Chunks of ``keys`` the master serves for ``holder`` from blocks it does not hold for them."""
    client, hp = holder.sched.holder._bg, holder.sched.holder
    res = client.lookup_and_lock(keys, reader="race-oracle")
    try:
        with hp._lock:
            return [f"{loc.key.hex()[:12]} on blocks {list(loc.block_ids)} (held: "
                    f"{list(hp._held[loc.key].blocks) if loc.key in hp._held else 'no'})"
                    for loc in list(res.locations)[: res.hit_chunks]
                    if loc.key not in hp._held or list(hp._held[loc.key].blocks) != list(loc.block_ids)]
    finally:
        if res.lock_id:
            client.release(res.lock_id, all_parties=True)


def test_a_re_publish_never_re_points_a_reclaimed_chunk(pair, monkeypatch):
    """Re-registration re-publishes what is held in groups by retention left; a pressure reclaim
    that unpublishes and frees chunks of a later group between two groups must fence that group."""
    holder, _ = pair(retention_s=60.0, publish_wait_s=2.0)
    hp = holder.sched.holder
    a, b = _tokens(2 * C + 1, 501), _tokens(2 * C + 1, 502)
    holder.run_request("a", a)
    holder.run_request("b", b)
    ka, kb = chunk_keys(holder, a), chunk_keys(holder, b)
    assert all(k in hp._held for k in ka + kb)
    now = time.monotonic()
    with hp._lock:  # b's chunks re-publish first (less retention left), a's in the second group
        for k in ka:
            hp._held[k].retain_until = now + 50
        for k in kb:
            hp._held[k].retain_until = now + 20
    real_publish, calls = hp._bg.publish, []

    def publish_then_reclaim(*args, **kwargs):
        out = real_publish(*args, **kwargs)
        calls.append([k for k, _ in args[1]])
        if len(calls) == 1:  # between the groups: a reclaim takes the oldest chunks (a's)
            hp.cap.reclaim_async(4)
            wait_until(lambda: not hp.cap.reclaiming, "the reclaim never ran", 5, poll=0.005)
            assert all(k not in hp._held for k in ka), "the reclaim did not take a's chunks"
        return out

    monkeypatch.setattr(hp._bg, "publish", publish_then_reclaim)
    hp._republish()
    assert calls and set(calls[0]) == set(kb), calls
    holder.sched.drain_frees()
    assert served_from_freed_blocks(holder, ka) == []
    assert served_from_freed_blocks(holder, kb) == []


def test_a_fenced_publish_retry_never_re_publishes_a_chunk_the_reaper_freed(pair, monkeypatch):
    """A publish fenced by a free elsewhere is retried for what is still held; the reaper freeing
    one of those chunks between the retry's check and its new sequence number must fence the retry."""
    holder, _ = pair(retention_s=60.0, publish_wait_s=0.0)
    hp = holder.sched.holder
    toks = _tokens(2 * C + 1, 511)
    keys = chunk_keys(holder, toks)
    gate = threading.Event()
    hp._publisher.submit(gate.wait, 10)  # the publisher thread is busy: the publish queues
    holder.run_request("p", toks)
    hp._hot.fence(hp.node_id)  # a free elsewhere fences every publish queued so far
    real_publish, real_next = hp._hot.publish, hp._hot.next_publish_seq
    state = {"fenced": 0, "reaped": False}

    def publish(*args, **kwargs):
        try:
            return real_publish(*args, **kwargs)
        except PublishFenced:
            state["fenced"] += 1
            raise

    def reap_first() -> None:
        # The reaper's turn: the chunks are due, it unpublishes (fenced) and forgets them.
        state["reaped"] = True
        with hp._lock:
            for k in keys:
                hp._held[k].retain_until = 0.0
            hp._wake.notify()
        wait_until(lambda: all(k not in hp._held for k in keys), "the reaper never freed them", 5, poll=0.005)

    def next_seq(node_id):
        # The retry's new number: in the gap after its held-check (if the lock is free there).
        if (threading.current_thread().name.startswith("pdxfer-publish") and state["fenced"]
                and not state["reaped"] and not hp._lock.locked()):
            reap_first()
        return real_next(node_id)

    monkeypatch.setattr(hp._hot, "publish", publish)
    monkeypatch.setattr(hp._hot, "next_publish_seq", next_seq)
    gate.set()
    wait_until(lambda: hp._publisher.submit(lambda: None).result(5) is None and state["fenced"],
               "the queued publish never ran", 10, poll=0.01)
    if not state["reaped"]:  # the retry took its number with the check: the reaper comes after
        reap_first()
    hp._publisher.submit(lambda: None).result(5)  # the retry, if any, has landed
    holder.sched.drain_frees()
    assert served_from_freed_blocks(holder, keys) == []


def test_a_failed_publish_does_not_cut_a_later_refresh_short(pair, monkeypatch):
    """A publish the master refused makes its chunks due at once, except those a later request
    refreshed meanwhile (its publish is queued behind): their retention is that request's."""
    holder, _ = pair(retention_s=60.0, publish_wait_s=0.0)
    hp = holder.sched.holder
    toks = _tokens(2 * C + 1, 521)
    keys = chunk_keys(holder, toks)
    gate = threading.Event()
    hp._publisher.submit(gate.wait, 10)
    real_publish, refused = hp._hot.publish, []

    def refuse_first(*args, **kwargs):
        if not refused:
            refused.append(args[1])
            raise MasterError("refused on purpose (the first publish)")
        return real_publish(*args, **kwargs)

    monkeypatch.setattr(hp._hot, "publish", refuse_first)
    holder.run_request("p", toks)
    holder.run_request("q", toks)  # the same prompt again: a refresh, queued behind p's publish
    gate.set()
    hp._publisher.submit(lambda: None).result(5)
    assert refused, "p's publish never reached the master"
    with hp._lock:
        left = {k.hex()[:12]: round(hp._held[k].retain_until - time.monotonic(), 1) for k in keys if k in hp._held}
    assert len(left) == len(keys) and min(left.values()) > 50, left
    assert served_from_freed_blocks(holder, keys) == []


def test_many_loads_validated_against_a_frozen_master_end_within_the_load_bound(frozen_master_pair):
    """Every load ends within load_timeout_s plus one master call (lookup_timeout_s) of its start,
    however many end together: their validations (release at the master) must not queue behind
    each other with no deadline. A frozen master answers none of them: every load is recomputed."""
    m, make = frozen_master_pair
    n, load_timeout, lookup_timeout = 12, 2.0, 0.5
    holder, reader = make(max_held_fraction=0.9, load_timeout_s=load_timeout, lookup_timeout_s=lookup_timeout)
    prompts = {f"d{i}": _tokens(C, 600 + i) for i in range(n)}
    for rid, toks in prompts.items():
        holder.run_request("p" + rid, toks)
    for rid, toks in prompts.items():  # every lookup answered (and locked) before the freeze
        ext, _ = reader.sched.get_num_new_matched_tokens(rid, toks, len(toks), 0, None)
        assert ext == C - 1, (rid, ext)
        blocks = reader.pool.get_new_blocks(-(-len(toks) // BS))
        reader.sched.update_state_after_alloc(rid, [b.block_id for b in blocks], ext)
    os.kill(m.proc.pid, signal.SIGSTOP)  # reads work (holder to reader); no release is answered
    started = time.monotonic()
    reader.worker.start_loads(reader.sched.build_connector_meta())
    ended: dict[str, float] = {}
    while len(ended) < n and time.monotonic() - started < 30:
        for rid in reader.worker.get_finished():
            ended.setdefault(rid, time.monotonic() - started)
        time.sleep(0.005)
    assert sorted(ended) == sorted(prompts), f"loads never ended: {sorted(set(prompts) - set(ended))}"
    bound = load_timeout + lookup_timeout + 0.5  # slack for this loaded machine's scheduling
    late = {rid: round(t, 2) for rid, t in ended.items() if t > bound}
    assert not late, f"loads past the {bound} s bound: {late}"
    assert reader.worker.take_load_errors(), "unvalidated bytes were used"
