"""How bytes move from a holder's blocks into a reader's when both have the same block format
and size: block pairs -> a :class:`pdxfer.transport.plan.TransferPlan` of coalesced byte runs.

Three steps, each in one place:
- chunk -> blocks (:func:`pdxfer.kv.chunks.chunk_span`) and a hit's chunks -> (holder blocks,
  reader blocks) pairs per holder (:func:`pdxfer.planning.hit_sources.pair_hit_blocks`);
- a :class:`PeerPlanner` made once per holder when the reader connects: the two layouts are
  checked for compatibility there, not on every read;
- :meth:`PeerPlanner.plan`: block pairs -> coalesced byte runs (whole blocks, or a TP head slice
  of head-major blocks of equal size, or whole (layer, head) segments of ``kv_head_nc``). Where both sides are block-outermost (vLLM's BLHNC, BLNHC,
  BHLNC: one block of every layer is one range) a run of consecutive blocks is one run, not one
  per layer.

Blocks of another size, byte format or head arrangement go through :mod:`pdxfer.planning.convert`
(staging + native scatter); :func:`pdxfer.planning.convert.planner_for` picks one of the two.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pdxfer.kv.layout import CPU, FLASH_HND, KV_HEAD_NC, KV_HNC, KVLayout, LayoutError, Segment
from pdxfer.transport.plan import TransferPlan, TransferRun, coalesce

# Formats whose block is head-major ([heads, ...] inside a block): one head's bytes (K and V) are
# one contiguous range, so a TP head slice between two such blocks of equal size is a byte range.
HEAD_MAJOR_FORMATS = (CPU, FLASH_HND, KV_HNC)


def check_compatible(remote: KVLayout, local: KVLayout) -> None:
    """Refuse a holder whose blocks cannot be copied byte for byte into ours, naming both sides."""
    if remote.fingerprint() != local.fingerprint():
        raise LayoutError(f"layouts differ: remote {remote.fingerprint()} vs local {local.fingerprint()}")
    if remote.block_size != local.block_size:
        raise LayoutError(f"block size differs (remote {remote.block_size}, local {local.block_size}); "
                          "blocks are opaque, so plans need equal block sizes")
    if [(s.layer, s.part, s.block_bytes) for s in remote.segments] != \
            [(s.layer, s.part, s.block_bytes) for s in local.segments]:
        raise LayoutError("layouts have the same fingerprint but different segment lists (layer names?)")


def check_head_slice(remote: KVLayout, local: KVLayout, src_head: int, dst_head: int, nheads: int) -> int:
    """Refuse a direct (unstaged) head-slice read unless both sides are one head-major format with
    equal block size, dtype, head_dim and segments; returns the bytes of one head in a block."""
    same = (remote.kv_format == local.kv_format and remote.dtype == local.dtype
            and remote.head_dim == local.head_dim and remote.block_size == local.block_size)
    if not same or remote.kv_format not in HEAD_MAJOR_FORMATS:
        raise LayoutError(f"a head slice is one byte range only between blocks of one head-major format "
                          f"({', '.join(HEAD_MAJOR_FORMATS)}) with equal block size, dtype and head_dim: holder "
                          f"has {remote.kv_format} {remote.dtype} block {remote.block_size} head_dim {remote.head_dim}, "
                          f"this reader {local.kv_format} {local.dtype} block {local.block_size} head_dim "
                          f"{local.head_dim}; use pdxfer.planning.convert.ConvertingPlanner")
    if [(s.layer, s.part) for s in remote.segments] != [(s.layer, s.part) for s in local.segments]:
        raise LayoutError("holder and reader name their layers differently")
    per_head = {s.block_bytes // remote.kv_heads for s in remote.segments} | \
        {s.block_bytes // local.kv_heads for s in local.segments}
    if len(per_head) != 1 or any(s.block_bytes % remote.kv_heads for s in remote.segments) \
            or any(s.block_bytes % local.kv_heads for s in local.segments):
        raise LayoutError("segment blocks are not kv_heads equal head ranges on both sides")
    for name, first, have in (("holder", src_head, remote.kv_heads), ("reader", dst_head, local.kv_heads)):
        if nheads <= 0 or first < 0 or first + nheads > have:
            raise LayoutError(f"heads [{first}, {first + nheads}) are outside the {have} kv heads of the "
                              f"{name}'s blocks")
    return per_head.pop()


def _head_segment_pairs(remote: KVLayout, local: KVLayout, src_head: int, dst_head: int,
                        nheads: int) -> list[tuple[Segment, Segment]]:
    """A head slice between caches with a segment per (layer, head) (``kv_head_nc``): whole
    segments, holder head ``src_head + j`` into reader head ``dst_head + j``."""
    if (remote.dtype, remote.head_dim, remote.block_size) != (local.dtype, local.head_dim, local.block_size):
        raise LayoutError(f"a head slice of kv_head_nc blocks is read in place only at equal dtype, head_dim and "
                          f"block size: holder has {remote.dtype} head_dim {remote.head_dim} block {remote.block_size}, "
                          f"this reader {local.dtype} head_dim {local.head_dim} block {local.block_size}; "
                          "use pdxfer.planning.convert.ConvertingPlanner")
    for name, first, have in (("holder", src_head, remote.kv_heads), ("reader", dst_head, local.kv_heads)):
        if nheads <= 0 or first < 0 or first + nheads > have:
            raise LayoutError(f"heads [{first}, {first + nheads}) are outside the {have} kv heads of the "
                              f"{name}'s blocks")
    mine = {(s.layer, s.head): s for s in local.segments}
    if {s.layer for s in remote.segments} != {s.layer for s in local.segments}:
        raise LayoutError("holder and reader name their layers differently")
    return [(s, mine[(s.layer, s.head - src_head + dst_head)]) for s in remote.segments
            if src_head <= s.head < src_head + nheads]


class PeerPlanner:
    """Plans from one holder's layout into this reader's: made once per holder at connect, so the
    compatibility check and the segment pairing are paid once, not on every read.

    With ``nheads`` (TP, see :func:`pdxfer.kv.heads.head_sources`) it moves only holder heads
    ``[src_head, src_head + nheads)`` into reader heads ``[dst_head, ...)``, straight into place;
    that needs one head-major format and equal block sizes (:func:`check_head_slice`), otherwise
    :class:`pdxfer.planning.convert.ConvertingPlanner` stages and scatters."""

    def __init__(self, remote: KVLayout, local: KVLayout, *, src_head: int = 0, dst_head: int = 0,
                 nheads: int | None = None) -> None:
        # (remote offset, local offset, bytes) inside each block; whole blocks by default.
        self._slice: tuple[int, int, int] | None = None
        all_heads = nheads is None or (nheads == remote.kv_heads == local.kv_heads and not src_head and not dst_head)
        pairs = list(zip(remote.segments, local.segments))
        if all_heads:
            check_compatible(remote, local)
        elif remote.kv_format == local.kv_format == KV_HEAD_NC:
            assert nheads is not None
            pairs = _head_segment_pairs(remote, local, src_head, dst_head, nheads)
        else:
            assert nheads is not None
            head_bytes = check_head_slice(remote, local, src_head, dst_head, nheads)
            self._slice = (src_head * head_bytes, dst_head * head_bytes, nheads * head_bytes)
        self.remote = remote
        self.local = local
        # (remote segment, local segment, both densely packed): dense segments move a run of
        # consecutive blocks as one byte range (never a head slice: slices of neighbouring blocks
        # are not adjacent).
        self._segments = [(rs, ls, self._slice is None and rs.block_stride == rs.block_bytes
                           and ls.block_stride == ls.block_bytes) for rs, ls in pairs]
        # Block-outermost caches (one block of every layer adjacent) packed alike on both sides:
        # (remote start, local start, cross-layer block bytes), so a run of consecutive blocks is
        # one byte range whatever the layer count.
        self._packed = _packed_blocks(remote.segments, local.segments) if all_heads else None

    def plan(self, remote_blocks: Sequence[int], local_blocks: Sequence[int],
             coalesce_runs: bool = True) -> TransferPlan:
        """Copy ``remote_blocks[i]`` of the holder into ``local_blocks[i]`` of the reader."""
        if len(remote_blocks) != len(local_blocks):
            raise LayoutError(f"{len(remote_blocks)} remote blocks but {len(local_blocks)} local blocks")
        self.remote.check_blocks(remote_blocks, "remote")
        self.local.check_blocks(local_blocks, "local")
        if len(set(local_blocks)) != len(local_blocks):
            raise LayoutError("local block ids repeat: two chunks would land in one block")

        # Pair up runs of block ids that are consecutive on both sides once, then emit one run per
        # (segment, block run) where a segment's blocks are densely packed: the cost scales with the
        # number of runs, not blocks x layers (this sits on the per-request path).
        block_runs: list[list[int]] = []  # [remote start, local start, count]
        for rb, lb in zip(remote_blocks, local_blocks):
            if coalesce_runs and block_runs:
                last = block_runs[-1]
                if last[0] + last[2] == rb and last[1] + last[2] == lb:
                    last[2] += 1
                    continue
            block_runs.append([rb, lb, 1])

        r_off, l_off, nbytes = self._slice or (0, 0, 0)
        n = len(self._segments) * len(remote_blocks)
        if coalesce_runs and self._packed is not None:
            region_r, start_r, region_l, start_l, stride = self._packed
            return TransferPlan(tuple(TransferRun(region_r, start_r + rb * stride, region_l, start_l + lb * stride,
                                                  count * stride) for rb, lb, count in block_runs), n)

        def generate() -> Iterable[TransferRun]:
            for rs, ls, dense in self._segments:
                size = nbytes or rs.block_bytes
                for rb, lb, count in block_runs:
                    if dense:
                        yield TransferRun(rs.region, rs.block_offset(rb), ls.region, ls.block_offset(lb),
                                          rs.block_bytes * count)
                    else:
                        for i in range(count):
                            yield TransferRun(rs.region, rs.block_offset(rb + i) + r_off, ls.region,
                                              ls.block_offset(lb + i) + l_off, size)

        runs = coalesce(generate()) if coalesce_runs else list(generate())
        return TransferPlan(tuple(runs), n)


def _cross_layer_block(segments: Sequence[Segment]) -> tuple[int, int, int, list[int]] | None:
    """(region, start, stride, segment order by address) where the segments' blocks tile one
    cross-layer block exactly (several segments, one region, one block stride), else None."""
    if len(segments) < 2 or len({(s.region, s.block_stride) for s in segments}) != 1:
        return None
    order = sorted(range(len(segments)), key=lambda i: segments[i].base)
    start = segments[order[0]].base
    at = start
    for i in order:
        if segments[i].base != at:
            return None
        at += segments[i].block_bytes
    stride = segments[0].block_stride
    return (segments[0].region, start, stride, order) if at - start == stride else None


def _packed_blocks(remote: Sequence[Segment], local: Sequence[Segment]) -> tuple[int, int, int, int, int] | None:
    """Where both sides pack each segment at the same place of one cross-layer block, copying
    block b of every segment is copying that block's whole range: (remote region, remote start,
    local region, local start, block bytes), else None."""
    r, l_ = _cross_layer_block(remote), _cross_layer_block(local)
    if r is None or l_ is None or r[2] != l_[2] or r[3] != l_[3]:
        return None
    return r[0], r[1], l_[0], l_[1], r[2]


def build_plan(remote: KVLayout, remote_blocks: Sequence[int], local: KVLayout, local_blocks: Sequence[int],
               coalesce_runs: bool = True) -> TransferPlan:
    """One-off plan (tests, benchmarks); readers keep a :class:`PeerPlanner` per holder instead."""
    return PeerPlanner(remote, local).plan(remote_blocks, local_blocks, coalesce_runs)
