"""The plan module's own pieces: a hit's block pairs per holder, and the per-peer planner."""

from __future__ import annotations

import pytest
import torch

from pdxfer.kv.layout import CPU, LayoutError, describe_kv_caches
from pdxfer.planning.peer_plan import PeerPlanner, build_plan
from pdxfer.planning.hit_sources import pair_hit_blocks
from tests.unit.test_layout import make_caches


def test_pair_hit_blocks_maps_token_blocks_to_each_holder():
    # Chunks 1..3 (256 tokens, 2 blocks of 128 each): chunk 1 and 3 on node a, chunk 2 on node b.
    holders = [("a", [10, 11]), ("b", [20, 21]), ("a", [12, 13])]
    local = list(range(100, 110))
    # Reader already has tokens [0, 384): the first block of chunk 1 is local, so it starts at block 3.
    pairs = pair_hit_blocks(1, holders, 256, 128, 384, 1024, local)
    assert pairs == {"a": ([11, 12, 13], [103, 106, 107]), "b": ([20, 21], [104, 105])}


def test_pair_hit_blocks_refuses_what_it_cannot_place():
    holders = [("a", [10, 11])]
    with pytest.raises(LayoutError, match="not block aligned"):
        pair_hit_blocks(0, holders, 256, 128, 100, 256, list(range(4)))
    # An end inside a block copies that block whole (the reader computes the rest itself).
    assert pair_hit_blocks(0, holders, 256, 128, 0, 200, list(range(4))) == {"a": ([10, 11], [0, 1])}
    with pytest.raises(LayoutError, match="has 1 holder blocks, expected 2"):
        pair_hit_blocks(0, [("a", [10])], 256, 128, 0, 256, list(range(4)))
    with pytest.raises(LayoutError, match="outside the hit"):
        pair_hit_blocks(0, holders, 256, 128, 0, 512, list(range(4)))
    with pytest.raises(LayoutError, match="the request has 1"):
        pair_hit_blocks(0, holders, 256, 128, 0, 256, [7])


def test_peer_planner_checks_the_pair_once_and_plans_like_build_plan():
    lay = describe_kv_caches(make_caches(CPU, 3, 16, 16, one_allocation=True))
    planner = PeerPlanner(lay, lay)
    assert planner.plan([1, 2, 3], [7, 8, 9]) == build_plan(lay, [1, 2, 3], lay, [7, 8, 9])
    other = describe_kv_caches(make_caches(CPU, 3, 16, 16, dtype=torch.float32))
    with pytest.raises(LayoutError, match="layouts differ"):
        PeerPlanner(lay, other)  # refused at connect, before any read is planned


def test_a_tail_copies_its_last_block_whole_and_only_to_the_prompts_end():
    # Chunk 0 full on node a, then a 200-token tail (2 blocks of 128, the last one partial).
    holders = [("a", [10, 11]), ("a", [12, 13])]
    local = list(range(100, 110))
    # The reader needs tokens [0, 455): every prompt token (456) but the last.
    pairs = pair_hit_blocks(0, holders, 256, 128, 0, 455, local, tail_tokens=200)
    assert pairs == {"a": ([10, 11, 12, 13], [100, 101, 102, 103])}
    # A prompt shorter than one chunk: the tail alone, chained from the root.
    assert pair_hit_blocks(0, [("b", [7])], 256, 128, 0, 99, local, tail_tokens=100) == {"b": ([7], [100])}
    with pytest.raises(LayoutError, match="tail of chunk 1 has 1 holder blocks, expected 2"):
        pair_hit_blocks(0, [("a", [10, 11]), ("a", [12])], 256, 128, 0, 455, local, tail_tokens=200)
    with pytest.raises(LayoutError, match="outside the hit"):  # past the tail's last token
        pair_hit_blocks(0, holders, 256, 128, 0, 457, local, tail_tokens=200)


def test_a_tail_inside_a_block_larger_than_the_chunk():
    # Chunk 64, blocks of 128: chunks 0 and 1 in block 10, a 22-token tail in block 11 (which
    # holds chunk 2's place); the reader needs tokens [0, 149).
    local = list(range(100, 110))
    holders = [("a", [10]), ("a", [10]), ("a", [11])]
    assert pair_hit_blocks(0, holders, 64, 128, 0, 149, local, tail_tokens=22) == {"a": ([10, 11], [100, 101])}
    # The last chunk listing a block is its source: chunk 0's block 9 may belong to a request
    # that parted after token 63; block 10 (chunk 1's) holds this prompt through token 127.
    assert pair_hit_blocks(0, [("b", [9]), ("a", [10])], 64, 128, 0, 127, local) == {"a": ([10], [100])}
    with pytest.raises(LayoutError, match="a tail has 1 to 63 tokens"):
        pair_hit_blocks(0, holders, 64, 128, 0, 149, local, tail_tokens=64)
