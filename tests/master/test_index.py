"""The index's rules, driven with explicit timestamps (the index takes `now` as an argument)."""

from __future__ import annotations

import pytest

from pdxfer.master.server.index import ChunkIndex, UnknownNodeError
from pdxfer.master.wire.protocol import pack_u32, unpack_u32

from .conftest import keys_for


def idx_with(*holders: tuple[str, list[int]], ttl: float = 10.0) -> tuple[ChunkIndex, list[bytes]]:
    """An index where each node holds the given chunk indices of one 10-key prompt."""
    ix = ChunkIndex()
    keys = keys_for("p", 10)
    for nid, chunks in holders:
        ix.register(nid, "{}", ttl, now=0.0)
        ix.publish(nid, [(keys[c], pack_u32([100 * c, 100 * c + 1])) for c in chunks], None, now=0.0)
    return ix, keys


def test_miss_hides_everything_after_it():
    ix, keys = idx_with(("a", [0, 1, 3, 4]))
    out = ix.lookup_and_lock(keys[:5], "r", 5.0, now=1.0)
    assert out.hit == 2
    assert unpack_u32(out.blocks) == [0, 1, 100, 101]


def test_prefers_the_node_with_the_longest_prefix_then_switches_minimally():
    ix, keys = idx_with(("a", [0, 1, 2]), ("b", [0, 1, 2, 3, 4]), ("c", [4, 5, 6]))
    out = ix.lookup_and_lock(keys[:8], "r", 5.0, now=1.0)
    assert out.hit == 7
    assert out.runs == [("b", 5), ("c", 2)]


def test_ties_rotate_among_the_holders_in_node_id_order():
    """Holders tied for the longest run take turns (node id order, one step per tie broken), so
    copies of one prefix on several engines share its reads."""
    ix, keys = idx_with(("z", [0, 1]), ("m", [0, 1]), ("a", [0]))
    got = [ix.lookup_and_lock(keys[:2], "r", 5.0, now=1.0 + t).runs for t in range(4)]
    assert got == [[("m", 2)], [("z", 2)], [("m", 2)], [("z", 2)]]  # "a"'s run is shorter: never chosen
    again, _ = idx_with(("z", [0, 1]), ("m", [0, 1]), ("a", [0]))
    assert [again.lookup_and_lock(keys[:2], "r", 5.0, now=1.0 + t).runs for t in range(4)] == got


def test_a_longer_run_always_wins_over_a_tie_elsewhere():
    ix, keys = idx_with(("b", [0, 1, 2]), ("c", [0, 1, 2]), ("long", [0, 1, 2, 3, 4]), ("x", [5]), ("y", [5]))
    for t in range(4):
        runs = ix.lookup_and_lock(keys[:6], "r", 5.0, now=1.0 + t).runs
        assert runs[0] == ("long", 5) and runs[1][0] in ("x", "y"), runs


def test_release_after_deadline_is_false_even_if_entry_exists():
    ix, keys = idx_with(("a", [0, 1]))
    lock = ix.lookup_and_lock(keys[:2], "r", 1.0, now=1.0).lock_id
    assert ix.release(lock, now=2.5) is False
    lock2 = ix.lookup_and_lock(keys[:2], "r", 1.0, now=3.0).lock_id
    assert ix.release(lock2, now=3.5) is True
    assert ix.release(lock2, now=3.6) is False  # a lock is released once


def test_unpublish_refused_while_locked_then_allowed():
    ix, keys = idx_with(("a", [0, 1]))
    lock = ix.lookup_and_lock(keys[:1], "r", 5.0, now=1.0).lock_id
    assert ix.unpublish_if_unlocked("a", keys[:2], now=2.0) == [1]  # chunk 1 was not locked
    assert ix.unpublish_if_unlocked("a", keys[:1], now=2.0) == []
    # the lock expired (never released): unpublish goes through
    assert ix.unpublish_if_unlocked("a", keys[:1], now=6.5) == [0]
    assert ix.release(lock, now=6.6) is False
    # keys that are gone (or never came) are reported as no longer published
    assert ix.unpublish_if_unlocked("a", keys[:2] + [b"\x07" * 32], now=7.0) == [0, 1, 2]
    assert ix.counters.unpublished == 2
    assert ix.n_entries == 0 and not ix.entries


def test_lease_expiry_drops_entries_and_invalidates_locks():
    ix, keys = idx_with(("a", [0, 1]), ("b", [0]), ttl=2.0)
    out = ix.lookup_and_lock(keys[:2], "r", 60.0, now=1.0)
    assert out.runs == [("a", 2)]
    assert ix.heartbeat("b", now=1.5) == 2.0  # b stays, a does not
    ix.expire(now=2.5)
    assert "a" not in ix.nodes and ix.n_entries == 1
    assert ix.release(out.lock_id, now=2.6) is False  # no lock outlives its node's lease
    assert ix.lookup_and_lock(keys[:2], "r", 5.0, now=2.7).runs == [("b", 1)]
    with pytest.raises(UnknownNodeError):
        ix.publish("a", [], None, now=3.0)
    assert ix.heartbeat("a", now=3.0) is None


def test_expired_node_is_not_served_even_before_the_reaper_runs():
    ix, keys = idx_with(("a", [0]), ttl=1.0)
    assert ix.lookup_and_lock(keys[:1], "r", 5.0, now=1.5).hit == 0


def test_retention_hides_entry_and_unpublish_succeeds():
    ix = ChunkIndex()
    keys = keys_for("r", 2)
    ix.register("a", "{}", 60.0, now=0.0)
    ix.publish("a", [(keys[0], pack_u32([1]))], 1.0, now=0.0)
    assert ix.lookup_and_lock(keys[:1], "r", 5.0, now=0.5).hit == 1
    assert ix.lookup_and_lock(keys[:1], "r", 5.0, now=1.5).hit == 0
    assert ix.unpublish_if_unlocked("a", keys[:1], now=7.0) == [0]


def test_republish_with_other_blocks_refused_while_locked():
    ix, keys = idx_with(("a", [0]))
    lock = ix.lookup_and_lock(keys[:1], "r", 5.0, now=1.0).lock_id
    assert ix.publish("a", [(keys[0], pack_u32([7]))], None, now=1.1) == 0
    assert ix.publish("a", [(keys[0], pack_u32([0, 1]))], None, now=1.1) == 1  # same blocks: refresh
    assert ix.release(lock, now=1.2)
    assert ix.publish("a", [(keys[0], pack_u32([7]))], None, now=1.3) == 1


def test_reregistration_starts_a_new_incarnation():
    ix, keys = idx_with(("a", [0]))
    lock = ix.lookup_and_lock(keys[:1], "r", 5.0, now=1.0).lock_id
    ix.register("a", "{}", 10.0, now=1.1)
    assert ix.n_entries == 0
    assert ix.release(lock, now=1.2) is False


def test_long_runs_end_at_the_first_miss_or_expired_entry_past_any_window():
    """Runs are read in growing windows: a run's end far from the start (a miss, or an entry past
    its retention) is found exactly, wherever it falls."""
    keys = keys_for("long", 700)
    for end in (1, 63, 64, 65, 511, 575, 576, 577, 699):
        ix = ChunkIndex()
        ix.register("a", "{}", 10.0, now=0.0)
        ix.register("b", "{}", 10.0, now=0.0)
        ix.publish("a", [(k, pack_u32([i])) for i, k in enumerate(keys[:end])], None, now=0.0)
        ix.publish("a", [(keys[end], pack_u32([end]))], 0.5, now=0.0)  # retained: over at 0.5
        ix.publish("a", [(k, pack_u32([i])) for i, k in enumerate(keys[end + 1 :], end + 1)], None, now=0.0)
        ix.publish("b", [(k, pack_u32([7])) for k in keys[end:]], None, now=0.0)
        out = ix.lookup_and_lock(keys, "r", 5.0, now=1.0)
        assert out.hit == 700 and out.runs[0] == ("a", end) and out.runs[1][0] == "b", (end, out.runs[:3])
        assert unpack_u32(out.blocks)[:end] == list(range(end)) and unpack_u32(out.blocks)[end] == 7
        assert ix.unpublish_if_unlocked("b", keys[end : end + 1], now=1.0) == []
        assert ix.lookup_and_lock(keys, "r", 5.0, now=1.0).hit == 700  # b's entry was pinned: kept
        assert ix.unpublish_if_unlocked("b", keys[end : end + 1], now=7.0) == [0]  # locks over
        assert ix.lookup_and_lock(keys, "r", 5.0, now=7.0).hit == end


def test_block_counts_follow_a_republish_with_another_count():
    # Every entry of "a" has 2 block ids, then one key is republished with 3 and one added with 1:
    # lookups must report each chunk's own count, never the count the node used to have for all.
    ix, keys = idx_with(("a", [0, 1, 2, 3]))
    first = ix.lookup_and_lock(keys[:4], "r", 5.0, now=1.0)
    assert first.counts == [2, 2, 2, 2] and ix.release(first.lock_id, now=1.0)
    assert ix.publish("a", [(keys[1], pack_u32([7, 8, 9])), (keys[4], pack_u32([5]))], None, now=1.0) == 2
    out = ix.lookup_and_lock(keys[:5], "r", 5.0, now=1.0)
    assert out.counts == [2, 3, 2, 2, 1]
    assert unpack_u32(out.blocks) == [0, 1, 7, 8, 9, 200, 201, 300, 301, 5]


def test_retention_ends_a_run_after_a_longer_held_publish():
    # Entries held forever, then one key republished with a short retention: once it is over, the
    # run ends before it although the node's other entries are held forever.
    ix, keys = idx_with(("a", [0, 1, 2, 3]))
    ix.publish("a", [(keys[2], pack_u32([200, 201]))], 1.0, now=0.0)
    assert ix.lookup_and_lock(keys[:4], "r", 5.0, now=0.5).hit == 4
    assert ix.lookup_and_lock(keys[:4], "r", 5.0, now=2.0).hit == 2


def test_a_run_with_its_keys_unpublished_keeps_nothing_of_them_alive():
    """One publish of 512 chunks, 511 of them unpublished (a host LRU evicting all but one hot
    chunk): the survivor must not pin the run's removed entries, keys and block ids."""
    import gc
    import tracemalloc

    ix = ChunkIndex()
    keys = keys_for("p", 512)
    ix.register("a", "{}", 60.0, now=0.0)
    tracemalloc.start()
    try:
        ix.publish("a", [(k, pack_u32(list(range(8 * i, 8 * i + 8)))) for i, k in enumerate(keys)], None, now=0.0)
        gc.collect()
        published = tracemalloc.get_traced_memory()[0]
        assert ix.unpublish_if_unlocked("a", keys[1:], now=1.0) == list(range(511))
        gc.collect()
        left = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # What stays is the node's dict table (a dict never shrinks) and the one survivor: before, the
    # run kept two thirds of the publish alive (155 of 236 kB here).
    assert left < published / 4, f"{left} B still allocated of {published} B after 511 of 512 entries went"
    out = ix.lookup_and_lock(keys[:1], "r", 5.0, now=2.0)
    assert out.hit == 1 and unpack_u32(out.blocks) == list(range(8)), "the survivor is served as before"
    assert ix.nodes["a"].entries[keys[0]].run is None
