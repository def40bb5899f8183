"""The reader's lookup (issue 16, holes 7 and 8), through both connector halves, a real master
process and the real TCP transport.

Hole 7: a holder this reader cannot read (another block size without staging, itself) must not
hide one it can read that has the same chunks. Hole 8: a decode waiting for a hinted publish
waits at most ``publish_hint_wait_s`` and never on vLLM's scheduler thread.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from pdxfer.master import MasterClient  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.test_connector_flow import BS, C, Node, _same_blocks, _tokens  # noqa: E402


def _master_lookups(addr: str) -> int:
    with MasterClient(addr, timeout_s=5.0) as c:
        return int(c.stats()["lookups"])


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(*args, **kw) -> Node:
        n = Node(*args, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def test_an_unreadable_holder_does_not_hide_a_readable_one(master, nodes):
    # 'a' holds more of the prompt (the master's greedy pick) in blocks of 64: a reader without
    # staging cannot read them. 'b' holds the first two chunks in blocks like the reader's.
    unreadable = nodes("h7a", master.address, True, False, seed=91, block_size=64)
    readable = nodes("h7b", master.address, True, False, seed=92)
    reader = nodes("r7", master.address, False, True, seed=None, staging_mib=0)
    toks = _tokens(3 * C + 5, 90)
    unreadable.run_request("p", toks)
    b_ids = readable.run_request("q", toks[: 2 * C + 7])
    before = _master_lookups(master.address)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == 2 * C and not errors
    n = 2 * C // BS
    assert _same_blocks(readable, b_ids[:n], reader, r_ids[:n])
    # The first meeting costs one more lookup (the reader learns what it cannot read); later
    # lookups name that holder at once.
    assert _master_lookups(master.address) - before == 2
    toks2 = toks[:C] + _tokens(2 * C + 9, 93)
    unreadable.run_request("p2", toks2)
    readable.run_request("q2", toks2[: 2 * C + 3])
    before = _master_lookups(master.address)
    assert reader.load("d2", toks2)[0] == 2 * C
    assert _master_lookups(master.address) - before == 1


def test_a_kv_both_instance_reads_from_another_holder_not_itself(master, nodes):
    # Same chunks on both; ties go to the smaller node id, which is this instance's own.
    both = nodes("a7both", master.address, True, True, seed=94)
    other = nodes("b7other", master.address, True, False, seed=95)
    toks = _tokens(2 * C + 5, 96)
    both.run_request("p", toks)
    o_ids = other.run_request("q", toks)
    ext, ids, errors = both.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _same_blocks(other, o_ids[: 2 * C // BS], both, ids[: 2 * C // BS])


# ---------------------------------------------------------------------------- hole 8


@pytest.fixture
def slow_master(master):
    """The module's master behind a real TCP proxy that holds every request 0.3 s."""
    from tests.master.tcp_proxy import TcpProxy

    host, port = master.address.rsplit(":", 1)
    proxy = TcpProxy(host, int(port), delay_s=0.3).start()
    try:
        yield proxy
    finally:
        proxy.close()


def _ask(reader: Node, rid: str, toks: list[int], hint: int) -> tuple[int | None, float]:
    t0 = time.monotonic()
    ext, _ = reader.sched.get_num_new_matched_tokens(rid, toks, len(toks), 0, None, hinted_tokens=hint)
    return ext, time.monotonic() - t0


def test_a_hinted_wait_ends_at_publish_hint_wait_s_even_with_a_slow_master(slow_master, nodes):
    wait_s = 0.35
    reader = nodes("r8a", slow_master.address, False, True, seed=None, lookup_timeout_s=0.5,
                   publish_hint_wait_s=wait_s)
    toks = _tokens(2 * C + 5, 97)  # announced, never published: the wait runs to its bound
    ext, took = _ask(reader, "d", toks, len(toks))
    assert ext is None and took >= 0.25  # the first lookup (a normal one) went through the slow master
    first_miss = time.monotonic()
    while ext is None:
        assert time.monotonic() - first_miss < 3.0, "the wait never ended"
        time.sleep(0.001)
        ext, _ = _ask(reader, "d", toks, len(toks))
    waited = time.monotonic() - first_miss
    assert ext == 0 and reader.sched.stats.publish_hint_timeouts == 1
    assert waited <= wait_s + 0.1, f"waited {waited * 1e3:.0f} ms for a bound of {wait_s * 1e3:.0f} ms"


def test_waiting_requests_never_block_the_scheduler_thread_on_the_master(slow_master, nodes):
    reader = nodes("r8b", slow_master.address, False, True, seed=None, lookup_timeout_s=0.5,
                   publish_hint_wait_s=0.6)
    prompts = {f"d{i}": _tokens(2 * C + 5, 100 + i) for i in range(3)}
    for rid, toks in prompts.items():  # each request's first lookup is the normal one
        assert _ask(reader, rid, toks, len(toks))[0] is None
    slowest, answered, deadline = 0.0, set(), time.monotonic() + 3.0
    while len(answered) < len(prompts):  # the engine's passes over its waiting requests
        assert time.monotonic() < deadline, "the waits never ended"
        for rid, toks in prompts.items():
            if rid in answered:
                continue
            ext, took = _ask(reader, rid, toks, len(toks))
            slowest = max(slowest, took)
            if ext is not None:
                answered.add(rid)
        time.sleep(0.002)
    assert slowest < 0.05, f"a waiting request held the scheduler thread {slowest * 1e3:.0f} ms"


def test_a_late_publish_is_found_by_the_waiting_lookup(master, nodes):
    holder = nodes("h8c", master.address, True, False, seed=98, publish_wait_s=0.0)
    reader = nodes("r8c", master.address, False, True, seed=None, publish_hint_wait_s=2.0)
    toks = _tokens(2 * C + 5, 99)
    ext, _ = _ask(reader, "d", toks, len(toks))
    assert ext is None  # nothing at the master yet: the request waits
    _, published = holder.finish("p", toks)  # the publish lands while the decode waits
    assert published == len(toks)
    t0 = time.monotonic()
    while ext is None:
        assert time.monotonic() - t0 < 2.0, "the late publish was never found"
        time.sleep(0.002)
        ext, _ = _ask(reader, "d", toks, len(toks))
    assert ext == len(toks) - 1
    assert reader.sched.stats.publish_hint_waits == 1 and reader.sched.stats.publish_hint_timeouts == 0
    assert len(reader.sched.stats.phases.take().get("phase_publish_wait_s", [])) == 1


def test_a_waiting_request_holds_one_lock_at_a_time(master, nodes):
    """Every lookup of the wait takes a lock; each newer answer gives the older one back, and
    the request goes on with the newest (a partial hit) when its bound passes."""
    holder = nodes("h8d", master.address, True, False, seed=101)
    reader = nodes("r8d", master.address, False, True, seed=None, publish_hint_wait_s=0.3)
    toks = _tokens(2 * C + 5, 102)
    holder.run_request("p", toks[: C + 5])  # the first chunk only: the second never comes
    with MasterClient(master.address, timeout_s=5.0) as c:
        base = int(c.stats()["locks"])
        ext, _ = _ask(reader, "d", toks, len(toks))
        t0 = time.monotonic()
        while ext is None:
            assert time.monotonic() - t0 < 2.0, "the wait never ended"
            time.sleep(0.002)
            ext, _ = _ask(reader, "d", toks, len(toks))
        assert ext == C and reader.sched.stats.publish_hint_timeouts == 1
        assert reader.sched.stats.lookups > 3  # the poller asked again and again
        wait_until(lambda: int(c.stats()["locks"]) == base + 1, "superseded locks of the wait were kept")
        reader.sched.reader.drop_lookup("d")
        wait_until(lambda: int(c.stats()["locks"]) == base, "the answer's lock was not given back")
