"""A hybrid model's hits, group by group (pdxfer.kv.groups, pdxfer.planning.group_hits): which
blocks a hit needs per group, when holders can serve it, and the block pairs of its reads."""

from __future__ import annotations

import pytest

from pdxfer.kv.groups import FULL, NOT_HELD, SLIDING, STATE, GroupError, GroupSpec, KVGroups, held_blocks
from pdxfer.kv.keys import KEY_BYTES, state_key
from pdxfer.planning.group_hits import GroupHit, group_block_pairs, servable_end

BS, C = 4, 8  # 2 blocks per chunk
GROUPS = KVGroups((GroupSpec(SLIDING, 6), GroupSpec(FULL)))


def _hit(entries, first_chunk=0, tail=0):
    return GroupHit(GROUPS, tuple(("h", tuple(e)) for e in entries), first_chunk, C, BS, tail)


def test_entries_name_every_groups_blocks_with_not_held_for_the_null_block():
    tables = ([0, 0, 7, 8], [1, 2, 3, 4])  # the sliding group freed its first two blocks
    assert GROUPS.entry(tables, 0, 2, null_block=0) == (NOT_HELD, NOT_HELD, 1, 2)
    assert GROUPS.entry(tables, 2, 2, null_block=0) == (7, 8, 3, 4)
    assert GROUPS.entry(tables, 3, 2, null_block=0) is None  # past the tables
    assert held_blocks((NOT_HELD, NOT_HELD, 1, 2)) == (1, 2)
    # A full-attention block is never freed early: a null one means the chunk serves nobody.
    assert GROUPS.entry(([5, 6], [0, 9]), 0, 2, null_block=0) is None
    # A plain model's tables have no null block: block 0 is a block like any other.
    assert KVGroups.plain().entry(([0, 1],), 0, 2) == (0, 1)


def test_the_window_a_hit_needs_is_vllms():
    window = GroupSpec(SLIDING, 6)
    # Attention at token `end` reads tokens [end - 5, end]: blocks before that are vLLM's null.
    assert [window.first_needed_block(e, BS) for e in (1, 5, 6, 9, 10, 13)] == [0, 0, 0, 1, 1, 2]
    assert GroupSpec(FULL).first_needed_block(1000, BS) == 0
    with pytest.raises(GroupError, match="needs"):
        GroupSpec(SLIDING)
    with pytest.raises(GroupError, match="kind"):
        GroupSpec("mamba")
    # A recurrent group's hit needs the one block holding the state after token end - 1.
    assert [GroupSpec(STATE).first_needed_block(e, BS) for e in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_the_group_table_travels_and_a_malformed_one_is_refused():
    assert KVGroups.from_wire(GROUPS.to_wire()) == GROUPS
    assert KVGroups.from_wire(None) == KVGroups.plain()
    assert GROUPS.signature() == "sliding6,full"
    for bad in ({"kind": "full"}, [{"window": 3}], [{"kind": "sliding"}]):
        with pytest.raises(GroupError):
            KVGroups.from_wire(bad)


def test_a_hit_is_served_where_every_group_is_and_cut_where_a_window_is_gone():
    # Two chunks (16 tokens): the holder freed sliding blocks 0 and 1.
    entries = [(NOT_HELD, NOT_HELD, 1, 2), (7, 8, 3, 4)]
    hit = _hit(entries)
    # end 15: the window needs blocks 2..3 (tokens 10..14): held.
    assert servable_end(hit, 0, 15)[0] == 15
    # end 8 (a chunk boundary): the window needs block 0 -> not held.
    assert not hit.servable(0, 8)
    # The holder also lost sliding block 2: the long hit fails; no shorter one is servable.
    worse = _hit([(NOT_HELD, NOT_HELD, 1, 2), (NOT_HELD, 8, 3, 4)])
    assert servable_end(worse, 0, 15)[0] == 0
    # What the reader has itself is never read: a local prefix of 8 tokens needs only blocks 2..3.
    assert _hit([(7, 8, 3, 4)], first_chunk=1).servable(8, 15)


def test_a_shorter_hit_at_a_chunk_boundary_is_taken_when_the_long_one_cannot_be_served():
    # Three chunks; the holder keeps only the window around token 16 (blocks 2, 3), not the end's.
    entries = [(NOT_HELD, NOT_HELD, 1, 2), (7, 8, 3, 4), (NOT_HELD, NOT_HELD, 5, 6)]
    end, cut = servable_end(_hit(entries), 0, 23)
    assert end == 16 and len(cut.entries) == 2 and cut.tail_tokens == 0


def test_the_block_pairs_of_each_group_and_the_reader_disagreeing_with_the_window():
    hit = _hit([(NOT_HELD, NOT_HELD, 1, 2), (7, 8, 3, 4)])
    # The reader's sliding table has the null block (0) where the window does not reach.
    assert group_block_pairs(hit, 0, 0, 15, [0, 0, 20, 21], 0) == {"h": ([7, 8], [20, 21])}
    assert group_block_pairs(hit, 1, 0, 15, [10, 11, 12, 13], 0) == {"h": ([1, 2, 3, 4], [10, 11, 12, 13])}
    with pytest.raises(GroupError, match="null block"):
        group_block_pairs(hit, 0, 0, 15, [0, 0, 0, 21], 0)
    with pytest.raises(GroupError, match="not held"):
        group_block_pairs(_hit([(NOT_HELD, NOT_HELD, 1, 2), (NOT_HELD, 8, 3, 4)]), 0, 0, 15, [0, 0, 20, 21], 0)


def test_a_tail_entry_serves_the_prompts_last_blocks():
    # One full chunk and a 6-token tail (2 blocks per group).
    hit = _hit([(NOT_HELD, 9, 1, 2), (7, 8, 3, 4)], tail=6)
    assert hit.block(0, 2) == ("h", 7) and hit.block(1, 3) == ("h", 4)
    assert servable_end(hit, 0, 13)[0] == 13
    with pytest.raises(GroupError, match="outside"):
        hit.block(0, 4)


def test_chunks_must_be_whole_blocks():
    with pytest.raises(GroupError, match="whole blocks"):
        GroupHit(GROUPS, (), 0, 6, BS)


# A gated delta-net hybrid: one recurrent group beside full attention (vLLM's group order).
STATE_GROUPS = KVGroups((GroupSpec(STATE), GroupSpec(FULL)))


def _state_hit(entries, tail=0):
    return GroupHit(STATE_GROUPS, tuple(("h", tuple(e)) for e in entries), 0, C, BS, tail)


def test_a_recurrent_group_names_only_its_final_state_block():
    # vLLM's "align" tables after 14 computed tokens: the running state in the last block only.
    tables = ([0, 0, 0, 9], [1, 2, 3, 4])
    assert STATE_GROUPS.entry(tables, 2, 2, null_block=0, state_final=True) == (NOT_HELD, 9, 3, 4)
    # Not final (a step may still write the state) or not the table's end: no state.
    assert STATE_GROUPS.entry(tables, 2, 2, null_block=0) == (NOT_HELD, NOT_HELD, 3, 4)
    assert STATE_GROUPS.entry(tables, 0, 2, null_block=0, state_final=True) == (NOT_HELD, NOT_HELD, 1, 2)
    assert STATE_GROUPS.entry(([0, 0, 0, 0], [1, 2, 3, 4]), 2, 2, null_block=0, state_final=True) == (
        NOT_HELD, NOT_HELD, 3, 4)
    assert STATE_GROUPS.signature() == "state,full" and STATE_GROUPS.has_state and not GROUPS.has_state
    assert KVGroups.from_wire(STATE_GROUPS.to_wire()) == STATE_GROUPS


def test_a_recurrent_hit_ends_exactly_where_a_holders_state_does():
    # Full chunk (no state at its end) and a 6-token tail whose entry holds the state after 14 tokens.
    hit = _state_hit([(NOT_HELD, NOT_HELD, 1, 2), (NOT_HELD, 9, 3, 4)], tail=6)
    assert servable_end(hit, 0, 14) == (14, hit)
    # The chunk boundary before has no state: nothing shorter is servable, the reader computes.
    assert servable_end(_state_hit([(NOT_HELD, NOT_HELD, 1, 2), (NOT_HELD, NOT_HELD, 3, 4)], tail=6), 0, 14)[0] == 0
    # The state goes into the reader's last block of the group, the attention blocks block for block.
    assert group_block_pairs(hit, 0, 0, 14, [0, 0, 0, 30], 0) == {"h": ([9], [30])}
    assert group_block_pairs(hit, 1, 0, 14, [10, 11, 12, 13], 0) == {"h": ([1, 2, 3, 4], [10, 11, 12, 13])}
    # vLLM reads the state from the table's last block: a table of another length is refused.
    with pytest.raises(GroupError, match="state in block 3 as the last"):
        group_block_pairs(hit, 0, 0, 14, [0, 0, 0, 30, 31], 0)
    # With a local prefix of 8 tokens the reader still needs the state at 14, and blocks 2..3.
    assert group_block_pairs(hit, 0, 8, 14, [0, 0, 0, 30], 0) == {"h": ([9], [30])}


def test_a_state_key_is_its_own_domain():
    key = bytes(range(KEY_BYTES))
    assert len(state_key(key)) == KEY_BYTES and state_key(key) != key
    assert state_key(key) != state_key(bytes(KEY_BYTES)) and state_key(key) == state_key(bytearray(key))
    with pytest.raises(ValueError, match="32-byte"):
        state_key(b"short")
