"""The running totals the index keeps for its metrics: held blocks and lock expiries."""

from __future__ import annotations

import random

from pdxfer.master.server.index import ChunkIndex
from pdxfer.master.wire.protocol import pack_u32

from .conftest import keys_for


def brute_held_blocks(ix: ChunkIndex) -> int:
    """Every entry's block count, summed from the entries themselves (what the total must equal)."""
    return sum(e.nblocks for holders in ix.entries.values() for e in holders.values())


def assert_totals(ix: ChunkIndex) -> None:
    assert ix.held_blocks == brute_held_blocks(ix)
    for node in ix.nodes.values():
        assert node.held_blocks == sum(e.nblocks for e in node.entries.values()), node.node_id


def test_held_blocks_follow_a_mixed_sequence():
    ix = ChunkIndex()
    keys = keys_for("held", 8)
    ix.register("a", "{}", 100.0, now=0.0)
    ix.register("b", "{}", 1.0, now=0.0)  # short lease: it expires below
    ix.register("c", "{}", 100.0, now=0.0)
    ix.publish("a", [(keys[i], pack_u32(range(i + 1))) for i in range(4)], None, now=0.0)  # 1+2+3+4
    ix.publish("b", [(keys[i], pack_u32([7, 8, 9])) for i in range(3)], None, now=0.0)  # 3 x 3
    ix.publish("c", [(keys[0], pack_u32([5, 6]))], None, now=0.0)
    assert ix.held_blocks == 10 + 9 + 2
    assert_totals(ix)
    # Re-publishing a key: the same blocks count once, another count replaces the old one.
    ix.publish("a", [(keys[0], pack_u32([0]))], None, now=0.1)
    ix.publish("a", [(keys[1], pack_u32([1, 2, 3, 4, 5]))], None, now=0.1)  # 2 -> 5 blocks
    assert ix.held_blocks == 24
    assert_totals(ix)
    # A re-publish refused under a valid lock changes nothing.
    lock = ix.lookup_and_lock(keys[:4], "r", 5.0, now=0.2)
    assert lock.runs == [("a", 4)]
    ix.publish("a", [(keys[2], pack_u32([9]))], None, now=0.3)
    assert ix.held_blocks == 24
    # Unpublish: a locked key stays, an unlocked one and an absent one go.
    ix.unpublish_if_unlocked("a", [keys[3], keys[7]], now=0.3)
    assert ix.held_blocks == 24
    ix.unpublish_if_unlocked("c", [keys[0], keys[7]], now=0.3)
    assert ix.held_blocks == 22
    assert_totals(ix)
    # b's lease runs out: the reaper drops its 9 blocks.
    ix.expire(1.5)
    assert "b" not in ix.nodes and ix.held_blocks == 13
    assert_totals(ix)
    # Re-registering starts a new incarnation with nothing held; deregistering drops the rest.
    ix.register("a", "{}", 100.0, now=2.0)
    assert ix.held_blocks == 0
    ix.publish("a", [(keys[5], pack_u32([1, 2]))], None, now=2.0)
    ix.publish("c", [(keys[5], pack_u32([3]))], None, now=2.0)
    assert ix.held_blocks == 3
    assert ix.deregister("c")
    assert ix.held_blocks == 2
    assert_totals(ix)
    ix.clear()
    assert ix.held_blocks == 0


def test_held_blocks_match_a_brute_force_sum_after_random_sequences():
    rng = random.Random(21)
    keys = keys_for("rand", 12)
    for trial in range(40):
        ix = ChunkIndex(max_entries=20)  # small: some publishes are refused for room
        now = 0.0
        locks: list[str] = []
        for step in range(80):
            now += rng.choice([0.0, 0.2, 0.7])
            n = rng.choice("abc")
            op = rng.random()
            try:
                if op < 0.15:
                    ix.register(n, "{}", rng.choice([1.0, 50.0]), now)
                elif op < 0.5:
                    chunks = rng.sample(range(12), rng.randint(1, 6))
                    ix.publish(n, [(keys[c], pack_u32(range(rng.randint(1, 5)))) for c in chunks], None, now)
                elif op < 0.65:
                    out = ix.lookup_and_lock(keys[: rng.randint(1, 12)], "r", rng.choice([0.3, 3.0]), now)
                    if out.lock_id:
                        locks.append(out.lock_id)
                elif op < 0.75 and locks:
                    ix.release(locks.pop(rng.randrange(len(locks))), now)
                elif op < 0.9:
                    ix.unpublish_if_unlocked(n, [keys[c] for c in rng.sample(range(12), 3)], now)
                elif op < 0.95:
                    ix.deregister(n)
                else:
                    ix.expire(now)
            except KeyError:  # an unknown or expired node: the call is refused, nothing applied
                pass
            assert ix.held_blocks == brute_held_blocks(ix), (trial, step)
        assert_totals(ix)


def test_a_lock_reaped_at_its_deadline_counts_as_an_expiry_not_a_release():
    ix = ChunkIndex()
    keys = keys_for("exp", 2)
    ix.register("a", "{}", 100.0, now=0.0)
    ix.publish("a", [(k, pack_u32([1])) for k in keys], None, now=0.0)
    released = ix.lookup_and_lock(keys, "r", 1.0, now=0.0)
    left = ix.lookup_and_lock(keys, "r", 1.0, now=0.0)
    late = ix.lookup_and_lock(keys, "r", 1.0, now=0.0)
    assert ix.release(released.lock_id, now=0.5) is True
    ix.expire(0.9)
    assert ix.counters.lock_expiries == 0  # nothing is past its deadline yet
    # A release after the deadline but before the reaper: an expired release, not a reaped lock.
    assert ix.release(late.lock_id, now=1.05) is False
    ix.expire(1.1)
    assert left.lock_id not in ix.locks
    c = ix.counters
    assert (c.lock_expiries, c.releases_ok, c.releases_expired) == (1, 1, 1)


def test_a_lock_dropped_with_its_node_is_no_expiry():
    ix = ChunkIndex()
    keys = keys_for("drop", 1)
    ix.register("a", "{}", 100.0, now=0.0)
    ix.publish("a", [(keys[0], pack_u32([1]))], None, now=0.0)
    ix.lookup_and_lock(keys, "r", 1.0, now=0.0)
    ix.deregister("a")
    ix.expire(5.0)
    assert ix.counters.lock_expiries == 0 and ix.counters.locks_invalidated == 1


def test_a_tp_lock_with_a_party_missing_counts_as_an_expiry():
    ix = ChunkIndex()
    keys = keys_for("tp", 1)
    ix.register("a", "{}", 100.0, now=0.0)
    ix.publish("a", [(keys[0], pack_u32([1]))], None, now=0.0)
    out = ix.lookup_and_lock(keys, "r", 1.0, now=0.0, parties=2)
    assert ix.release(out.lock_id, now=0.1) is True  # one rank of two released
    ix.expire(2.0)
    assert ix.counters.lock_expiries == 1
