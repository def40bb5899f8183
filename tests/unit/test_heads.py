"""TP head split (vLLM's) and where a reader rank gathers its heads from."""

from __future__ import annotations

import itertools

import pytest

from pdxfer.kv.heads import HeadSlice, HeadSource, head_sources, rank_heads

SIZES = (1, 2, 4, 8)


def test_rank_heads_matches_vllm_split():
    # H >= T: consecutive slices; H < T: one head per rank, rank r holds head r*H//T.
    assert [rank_heads(8, 2, r) for r in range(2)] == [HeadSlice(0, 4), HeadSlice(4, 4)]
    assert [rank_heads(8, 8, r) for r in range(8)] == [HeadSlice(r, 1) for r in range(8)]
    assert [rank_heads(2, 8, r).first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [rank_heads(1, 4, r) for r in range(4)] == [HeadSlice(0, 1)] * 4


def _vllm_shard_rank(h: int, t: int, r: int) -> HeadSlice:
    """vLLM's QKVParallelLinear weight loading, restated: shard r // replicas of size num_kv_heads."""
    if t >= h:
        num_kv_heads, replicas = 1, t // h
    else:
        num_kv_heads, replicas = h // t, 1
    return HeadSlice(r // replicas * num_kv_heads, num_kv_heads)


@pytest.mark.parametrize("h,t", list(itertools.product(SIZES, SIZES)))
def test_rank_heads_equals_vllm_shard_formula(h, t):
    assert [rank_heads(h, t, r) for r in range(t)] == [_vllm_shard_rank(h, t, r) for r in range(t)]


@pytest.mark.parametrize("h,holder_tp,reader_tp", list(itertools.product(SIZES, SIZES, SIZES)))
def test_every_reader_head_covered_once_by_a_holder_rank_that_holds_it(h, holder_tp, reader_tp):
    used_replicas: dict[int, set[int]] = {}
    for rr in range(reader_tp):
        mine = rank_heads(h, reader_tp, rr)
        covered = [0] * mine.count
        for s in head_sources(h, holder_tp, reader_tp, rr):
            assert 0 <= s.holder_rank < holder_tp and s.nheads > 0
            theirs = rank_heads(h, holder_tp, s.holder_rank)
            assert 0 <= s.src_head and s.src_head + s.nheads <= theirs.count  # the holder rank has them
            for i in range(s.nheads):
                # the same model head on both sides
                assert theirs.first + s.src_head + i == mine.first + s.dst_head + i
                covered[s.dst_head + i] += 1
            used_replicas.setdefault(theirs.first, set()).add(s.holder_rank)
        assert covered == [1] * mine.count
    # Readers of a replicated head spread over its copies (as far as there are readers of it).
    if holder_tp > h:
        readers_per_head = max(1, reader_tp // h)
        for head, ranks in used_replicas.items():
            assert len(ranks) == min(holder_tp // h, readers_per_head), (head, ranks)


def test_head_sources_shapes():
    # reader TP 1 from holder TP 2: half the heads from each rank.
    assert head_sources(8, 2, 1, 0) == [HeadSource(0, 0, 0, 4), HeadSource(1, 0, 4, 4)]
    # reader TP 2 from holder TP 1: a slice of rank 0.
    assert head_sources(8, 1, 2, 1) == [HeadSource(0, 4, 0, 4)]
    # MQA, both TP 2: each reader takes its own replica.
    assert head_sources(1, 2, 2, 0) == [HeadSource(0, 0, 0, 1)]
    assert head_sources(1, 2, 2, 1) == [HeadSource(1, 0, 0, 1)]


@pytest.mark.parametrize("args", [(0, 1, 0), (8, 0, 0), (8, 2, 2), (6, 4, 0), (2, 3, 0), (8, 2, -1)])
def test_rank_heads_refuses_impossible_splits(args):
    with pytest.raises(ValueError):
        rank_heads(*args)
