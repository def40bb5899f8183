"""A lookup's chunk locations -> the reads of one load into the request's blocks.

Shared by the scheduler half (the load it hands to the workers) and the worker half (a re-pull
from another holder after a read failed): both must plan exactly alike, or a re-pull would write
other positions than the read it replaces.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from pdxfer.planning.hit_sources import ChunkPlace, Piece, hit_pieces, servable_end, token_reads
from pdxfer.planning.hit_sources import pair_hit_blocks
from pdxfer.vllm.metadata import NodeRead


@dataclass(frozen=True)
class HitShape:
    """Where a hit sits in the prompt: ``locations[i]`` = (holder node, its block ids) of chunk
    ``first_chunk + i``; with ``tail_tokens`` > 0 the last location is the prompt's partial last
    chunk of that many tokens. ``block_sizes``: each holder's block size."""

    first_chunk: int
    locations: tuple[tuple[str, tuple[int, ...]], ...]
    block_sizes: Mapping[str, int]
    chunk_tokens: int
    tail_tokens: int = 0

    def same_block_size(self, block_size: int) -> bool:
        return all(self.block_sizes[n] == block_size for n, _ in self.locations)

    def pieces(self) -> list[Piece]:
        places = [ChunkPlace(n, self.block_sizes[n], ids) for n, ids in self.locations]
        return hit_pieces(self.first_chunk, places, self.chunk_tokens, self.tail_tokens)


def exact_end(hit: HitShape, block_size: int, start: int, end: int) -> int:
    """``end``, or less where holders of other block sizes cannot serve tokens ``[start, end)``
    exactly into reader blocks of ``block_size`` (LayoutError when the blocks do not fit the chunks)."""
    if end <= start or hit.same_block_size(block_size):
        return end
    return servable_end(hit.pieces(), start, end, block_size)


def plan_reads(hit: HitShape, block_size: int, start: int, end: int,
               block_ids: Sequence[int]) -> tuple[NodeRead, ...]:
    """Reads loading tokens ``[start, end)`` (``start`` block aligned; a partial last block is
    read whole) into the request's block table ``block_ids``; LayoutError when they cannot be."""
    if hit.same_block_size(block_size):
        per_node = pair_hit_blocks(hit.first_chunk, list(hit.locations), hit.chunk_tokens, block_size, start, end,
                                   block_ids, tail_tokens=hit.tail_tokens)
        return tuple(NodeRead(nid, tuple(r), tuple(loc)) for nid, (r, loc) in per_node.items())
    reads = token_reads(hit.pieces(), start, end, block_ids, block_size)
    return tuple(NodeRead(r.node_id, r.remote_blocks, r.local_blocks) if not r.staged else
                 NodeRead(r.node_id, r.remote_blocks, r.local_blocks, r.remote_block_size, r.remote_first_token,
                          r.local_first_token, r.start, r.end - r.start)
                 for r in reads)


def first_written(read: NodeRead, block_ids: Sequence[int], block_size: int) -> int:
    """The first token position ``read`` may write into the request whose block table is
    ``block_ids`` (a whole-block read writes its first block from the block's first token)."""
    if read.remote_block_size:
        return read.start
    pos = {int(b): i for i, b in enumerate(block_ids)}
    return min(pos[int(b)] for b in read.local_blocks) * block_size


def split_by_tier(read: NodeRead, host_base: int) -> list[tuple[bool, NodeRead]]:
    """``read`` as reads that each stay in one tier of its holder, as (on the host tier, the
    read): each tier is planned against its own layout, so host slot ids (block ids from
    ``host_base`` on) become slot numbers. A block-for-block read splits into its device pairs
    and its host pairs. A token-range read splits into maximal runs of holder blocks of one
    tier, each clipped to the tokens of the whole read its blocks hold; a run holding none of
    them is left out. The reader side (blocks, first token) stays the whole read's: a staged
    piece finds its reader blocks from its tokens, so the parts write exactly what the whole
    read would."""
    if not read.remote_block_size:
        out = []
        for host in (False, True):
            pairs = [(b, lb) for b, lb in zip(read.remote_blocks, read.local_blocks) if (b >= host_base) == host]
            if pairs:
                base = host_base if host else 0
                out.append((host, dataclasses.replace(read, remote_blocks=tuple(b - base for b, _ in pairs),
                                                      local_blocks=tuple(lb for _, lb in pairs))))
        return out
    hb, end = read.remote_block_size, read.start + read.num_tokens
    out, at = [], 0
    for host, run in itertools.groupby(read.remote_blocks, key=lambda b: b >= host_base):
        ids = tuple(run)
        first = read.remote_first_token + at * hb
        at += len(ids)
        s, e = max(read.start, first), min(end, first + len(ids) * hb)
        if s < e:
            base = host_base if host else 0
            out.append((host, dataclasses.replace(read, remote_blocks=tuple(b - base for b in ids),
                                                  remote_first_token=first, start=s, num_tokens=e - s)))
    return out
