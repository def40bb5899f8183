"""A read naming blocks of both tiers of a holder (KV cache and host slots) split into reads that
each stay in one tier (``pdxfer.vllm.load_plan.split_by_tier``): exactly at the boundaries, host
ids made slot numbers, and, for token ranges, writing exactly the reader tokens the whole read
would (checked through the staged pieces the worker makes of each part)."""

from __future__ import annotations

from types import SimpleNamespace

from pdxfer.vllm.load_plan import split_by_tier
from pdxfer.vllm.metadata import NodeRead
from pdxfer.vllm.worker.staging import StagedStream

N = 100  # the holder's device block count: host slot s is block N + s


def _ranged(blocks, rft, start, ntok, hb=128, local=tuple(range(40, 56)), lft=0) -> NodeRead:
    return NodeRead("h", tuple(blocks), tuple(local), hb, rft, lft, start, ntok)


def _pieces(r: NodeRead, host_base: int, lb: int = 32) -> list[tuple]:
    """Per holder block of ``r`` with a token to move: (its holder block id as the master names
    it, what the staged piece of that block alone writes: reader blocks, their first token,
    tokens). The part's first/end as ``ReaderStaging.stream`` computes them."""
    hb = r.remote_block_size
    planner = SimpleNamespace(remote=SimpleNamespace(block_size=hb), local=SimpleNamespace(block_size=lb))
    first = (r.start - r.remote_first_token) // hb
    end = min(len(r.remote_blocks), -(-(r.start + r.num_tokens - r.remote_first_token) // hb))
    s = StagedStream(planner, "peer", r, False, first, end, first)
    out = []
    for i in range(first, end):
        p = s.piece(i, i + 1)
        out.append((p.remote_blocks[0] + host_base, p.remote_first_token, p.local_blocks, p.local_first_token,
                    p.start, p.ntokens))
    return out


def test_pairs_split_into_device_and_host_pairs_with_slot_numbers():
    r = NodeRead("h", (3, 4, N, N + 1, 9, N + 7), (10, 11, 12, 13, 14, 15))
    got = split_by_tier(r, N)
    assert got == [(False, NodeRead("h", (3, 4, 9), (10, 11, 14))), (True, NodeRead("h", (0, 1, 7), (12, 13, 15)))]
    assert split_by_tier(NodeRead("h", (N + 2,), (5,)), N) == [(True, NodeRead("h", (2,), (5,)))]


def test_a_device_only_read_is_left_whole():
    r = _ranged((3, 4, 5), 0, 0, 383)
    assert split_by_tier(r, N) == [(False, r)]
    p = NodeRead("h", (1, 2), (7, 8))
    assert split_by_tier(p, N) == [(False, p)]


def test_token_ranges_split_exactly_at_the_tier_boundaries():
    # Holder blocks of 128 tokens: [0,128) device, [128,384) host slots 0-1, [384,512) device.
    r = _ranged((3, N, N + 1, 7), 0, 0, 511)
    got = split_by_tier(r, N)
    assert [(h, x.remote_blocks, x.remote_first_token, x.start, x.num_tokens) for h, x in got] == [
        (False, (3,), 0, 0, 128), (True, (0, 1), 128, 128, 256), (False, (7,), 384, 384, 127)]
    assert all(x.local_blocks == r.local_blocks and x.local_first_token == r.local_first_token
               and x.remote_block_size == 128 for _, x in got)


def test_token_range_parts_cover_the_whole_reads_tokens_once():
    # Starts inside a host block and ends inside a device block, from holder token 256 on; the
    # reader's blocks start at token 288 (a re-pull's part, say).
    r = _ranged((N + 3, 8, 9, N + 4, N + 5), 256, 300, 500, local=tuple(range(20, 37)), lft=288)
    got = split_by_tier(r, N)
    spans = [(x.start, x.start + x.num_tokens) for _, x in got]
    assert spans == [(300, 384), (384, 640), (640, 800)]
    assert [h for h, _ in got] == [True, False, True]
    assert sum(e - s for s, e in spans) == r.num_tokens
    # Every holder block's staged piece writes the same reader tokens into the same reader blocks.
    assert [x for h, part in got for x in _pieces(part, N if h else 0)] == _pieces(r, 0)


def test_runs_without_a_token_of_the_read_are_left_out():
    # The read needs tokens [130, 300): the leading host block and the trailing one hold none.
    r = _ranged((N, 5, 6, N + 1), 0, 130, 170)
    got = split_by_tier(r, N)
    assert [(h, x.remote_blocks, x.remote_first_token, x.start, x.num_tokens) for h, x in got] == [
        (False, (5, 6), 128, 130, 170)]
    assert [x for _, part in got for x in _pieces(part, 0)] == _pieces(r, 0)
