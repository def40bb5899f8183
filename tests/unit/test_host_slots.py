"""The host tier's slot allocator and host-only LRU (pdxfer.vllm.scheduler.host_slots)."""

from __future__ import annotations

import pytest

from pdxfer.vllm.scheduler.host_slots import HostSlotError, HostSlots


def test_allocate_is_all_or_nothing_and_free_makes_room():
    hs = HostSlots(4)
    a = hs.allocate(3)
    assert a is not None and len(set(a)) == 3 and all(0 <= s < 4 for s in a)
    assert hs.allocate(2) is None and hs.free_count == 1  # nothing taken by the refusal
    b = hs.allocate(1)
    assert b is not None and not set(a) & set(b)
    hs.free(a)
    c = hs.allocate(3)
    assert c is not None and set(c) == set(a) and hs.free_count == 0


def test_bad_calls_are_refused_by_name():
    hs = HostSlots(2)
    with pytest.raises(HostSlotError, match="allocate wants a slot count"):
        hs.allocate(0)
    with pytest.raises(HostSlotError, match="not allocated"):
        hs.free([1])
    a = hs.allocate(1)
    hs.free(a)
    with pytest.raises(HostSlotError, match="double free"):
        hs.free(a)
    with pytest.raises(HostSlotError, match="int >= 0"):
        HostSlots(-1)


def test_a_host_only_chunks_slots_cannot_be_freed_until_it_is_popped():
    hs = HostSlots(3)
    s = hs.allocate(2)
    hs.add_host_only(b"k1", s)
    with pytest.raises(HostSlotError, match="host-only chunk"):
        hs.free(s)
    assert hs.free_count == 1 and b"k1" in hs
    assert hs.pop_host_only(b"k1") == s
    hs.free(s)
    assert hs.free_count == 3 and len(hs) == 0


def test_lru_order_follows_use():
    hs = HostSlots(7)
    for k in (b"a", b"b", b"c"):
        hs.add_host_only(k, hs.allocate(2))
    assert [k for k, _ in hs.oldest()] == [b"a", b"b", b"c"]
    assert hs.touch(b"a") and not hs.touch(b"zz")
    assert [k for k, _ in hs.oldest()] == [b"b", b"c", b"a"]
    with pytest.raises(HostSlotError, match="already host-only"):
        hs.add_host_only(b"b", ())
    with pytest.raises(HostSlotError, match="unallocated"):
        hs.add_host_only(b"d", (6,))


def test_no_tier():
    hs = HostSlots(0)
    assert hs.allocate(1) is None and hs.free_count == 0
