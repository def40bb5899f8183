"""Moving KV between holders and readers whose block size, byte format or TP head split differ.

A block is opaque bytes and, in vLLM's CPU layout, tokens are not contiguous inside it (K is
stored transposed), so a token range cannot be READ straight into blocks of another size or
format. The reader READs the holder's whole blocks into a registered *staging* area instead, then
scatters the token range into its own blocks with the native kernels
(``pdxfer.device.native.scatter_tokens``, threaded C++; a torch path where the library is absent), one
K or V part at a time: any two formats with a block geometry (:mod:`pdxfer.kv.blockgeom`: cpu,
flash_nhd, flash_hnd, blocks_first_nhd) convert into each other at any pair of block sizes.
Parts are matched by (layer, K or V), so a CPU "kv" segment's K^T part feeds a flash "k" segment.

Tensor parallelism: a planner moves one holder rank's heads ``[src_head, src_head + nheads)`` into
heads ``[dst_head, ...)`` of the reader's blocks (:func:`pdxfer.kv.heads.head_sources` says which);
holder and reader ``kv_heads`` are each that rank's count. Where the holder's format keeps a
head's bytes together (cpu, flash_hnd), only the slice is READ.

Same-format same-size reads never come here: they are READ straight into place
(:class:`pdxfer.planning.peer_plan.PeerPlanner`; all heads, or a head slice of cpu/flash_hnd blocks, which is
one byte range per block); :func:`planner_for` chooses. Refused, naming both sides (:func:`check_convertible`):
different dtype (converting would change the numbers), head_dim or layer names, and cpu_amx,
whose AMX-packed blocks have no geometry.

Staging layout of one read: for holder segment ``s`` (layer, or K/V of a layer) and staged holder
block ``i``: ``offset + seg_offset[s] + i * staged_block_bytes[s]`` inside the staging region.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdxfer.device import native
from pdxfer.kv.blockgeom import BlockGeometry, segment_geometry, token_runs
from pdxfer.kv.layout import CPU_AMX, MLA, KVLayout, LayoutError, Segment
from pdxfer.planning.peer_plan import HEAD_MAJOR_FORMATS, PeerPlanner
from pdxfer.transport.plan import TransferPlan, TransferRun, coalesce

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1,
                "int8": 1}


def _side(kv: KVLayout) -> str:
    return (f"dtype {kv.dtype} ({kv.kv_format}, {kv.kv_heads} kv heads, head_dim {kv.head_dim}, "
            f"{kv.num_layers} layers, block size {kv.block_size})")


def _parts_of(kv: KVLayout, s: Segment, geom: BlockGeometry) -> list[tuple[str, int]]:
    """(K, V or latent, part index in the segment's geometry) of one segment."""
    if s.part == "kv" and len(geom.parts) == 2:
        return [("k", 0), ("v", 1)]  # the geometries put K first (cpu: K^T, the others: K)
    if s.part in ("k", "v", "latent") and len(geom.parts) == 1:
        return [(s.part, 0)]
    raise LayoutError(f"segment {s.layer}/{s.part} does not fit format {kv.kv_format} "
                      f"({len(geom.parts)} parts per segment)")


def _head_parts(kv: KVLayout, geom: BlockGeometry) -> dict[tuple[str, str, int], tuple[int, int, int]]:
    """(layer, "k"/"v"/"latent", head) -> (segment index, part index, head in the segment's
    geometry): a segment holds every head of its layer, or one (``Segment.head``, kv_head_nc)."""
    out: dict[tuple[str, str, int], tuple[int, int, int]] = {}
    for i, s in enumerate(kv.segments):
        heads = [(s.head, 0)] if s.head >= 0 else [(h, h) for h in range(kv.kv_heads)]
        for which, p in _parts_of(kv, s, geom):
            for head, in_geom in heads:
                if (s.layer, which, head) in out:
                    raise LayoutError(f"layer {s.layer} has two {which.upper()} segments for head {head}")
                out[(s.layer, which, head)] = (i, p, in_geom)
    return out


def _refusal(remote: KVLayout, local: KVLayout) -> str | None:
    """Why the holder's blocks cannot be converted into ours, or None."""
    for side, kv in (("holder", remote), ("reader", local)):
        if kv.kv_format == CPU_AMX:
            return (f"the {side}'s format cpu_amx packs blocks for AMX tiles and has no known block "
                    "geometry, so its tokens cannot be located")
        try:
            segment_geometry(kv)
        except ValueError as exc:
            return f"the {side}'s format has no block geometry: {exc}"
    if remote.kind != local.kind:
        return f"the holder stores {remote.kind} KV and this reader {local.kind} KV"
    if remote.dtype != local.dtype:
        return "dtypes differ; converting them would change the numbers"
    if local.dtype not in _DTYPE_BYTES:
        return f"dtype {local.dtype} is not one pdxfer knows the element size of"
    if remote.head_dim != local.head_dim:
        return "head_dim differs"
    if {s.layer for s in remote.segments} != {s.layer for s in local.segments}:
        return "layer names differ"
    for side, kv in (("holder", remote), ("reader", local)):
        geom = segment_geometry(kv)
        try:
            parts = _head_parts(kv, geom)
        except LayoutError as exc:
            return f"the {side}'s segments are inconsistent: {exc}"
        kinds = ("latent",) if kv.kind == MLA else ("k", "v")
        if len(parts) != len(kinds) * kv.num_layers * kv.kv_heads or {w for _, w, _ in parts} != set(kinds):
            return f"the {side} lacks {' or '.join(k.upper() for k in kinds)} of some layer or head"
        elem = _DTYPE_BYTES[kv.dtype]
        need = max(geom.part_extent(p) for p in range(len(geom.parts))) * elem
        if any(s.block_bytes < need for s in kv.segments):
            return f"the {side}'s segment blocks are smaller than its format's geometry ({need} bytes)"
    return None


def check_convertible(remote: KVLayout, local: KVLayout) -> None:
    """Refuse, at connect time, a holder whose KV this reader cannot convert (any block sizes,
    formats with a geometry, head counts); the error names what differs and both sides."""
    why = _refusal(remote, local)
    if why is not None:
        raise LayoutError(f"cannot convert KV blocks ({why}): holder has {_side(remote)}, "
                          f"this reader {_side(local)}")


@dataclass(frozen=True)
class StagedRead:
    """One holder's token range, READ into staging and then scattered into the reader's blocks."""

    plan: TransferPlan  # holder blocks -> staging
    staging_offset: int
    staging_bytes: int
    remote_first_token: int  # token index of the first staged holder block's first token
    local_blocks: tuple[int, ...]
    local_first_token: int  # token index of local_blocks[0]'s first token
    start: int  # tokens [start, start + ntokens) are copied
    ntokens: int


@dataclass(frozen=True, eq=False)  # eq=False: == on the runs array would not give a bool
class ScatterCall:
    """One ``scatter_tokens`` call of a staged read's scatter (:meth:`ConvertingPlanner.scatter_calls`):
    from the staging region into reader region ``region``."""

    region: int  # index of the reader's KV region written
    runs: np.ndarray  # token runs (pdxfer.kv.blockgeom.token_runs rows), byte offsets into staging and the region
    src_geom: BlockGeometry  # the staged holder blocks' geometry (one part, or all)
    dst_geom: BlockGeometry  # the reader blocks' geometry (one part, or all)
    elem_size: int  # bytes per element of both sides' dtype


class ConvertingPlanner:
    """Plans from one holder (rank) whose blocks differ from the reader's in size, format or head
    split; made once per holder at connect, like PeerPlanner. Refuses, naming both sides, what it
    cannot convert.

    ``src_head``/``dst_head``/``nheads``: copy holder heads ``[src_head, src_head + nheads)`` into
    reader heads ``[dst_head, ...)`` (rank-relative; see :func:`pdxfer.kv.heads.head_sources`). The
    default, ``nheads=None``, means every head and needs equal ``kv_heads`` on both sides.
    """

    def __init__(self, remote: KVLayout, local: KVLayout, staging_region: int, *, src_head: int = 0,
                 dst_head: int = 0, nheads: int | None = None) -> None:
        check_convertible(remote, local)
        if nheads is None:
            if remote.kv_heads != local.kv_heads or src_head or dst_head:
                raise LayoutError(f"holder has {remote.kv_heads} kv heads per block, this reader {local.kv_heads}: "
                                  "pass src_head, dst_head and nheads (pdxfer.kv.heads.head_sources says which)")
            nheads = local.kv_heads
        for name, first, have in (("holder", src_head, remote.kv_heads), ("reader", dst_head, local.kv_heads)):
            if nheads <= 0 or first < 0 or first + nheads > have:
                raise LayoutError(f"heads [{first}, {first + nheads}) are outside the {have} kv heads of the "
                                  f"{name}'s blocks")
        self.remote = remote
        self.local = local
        self.staging_region = staging_region
        self.src_head, self.dst_head, self.nheads = src_head, dst_head, nheads
        self._elem = _DTYPE_BYTES[local.dtype]
        self._dst_geom = segment_geometry(local)
        # What is staged per holder block and segment: the whole block, or only the head slice
        # where the format keeps a head's bytes together (then the staged block is a block of the
        # same format with nheads heads, and the copy starts at its head 0).
        self._slice_off = 0
        self._staged_src_head = src_head
        self._seg_bytes = [s.block_bytes for s in remote.segments]
        self._src_geom = segment_geometry(remote)
        per_head = {s.block_bytes // remote.kv_heads for s in remote.segments}
        if nheads < remote.kv_heads and remote.kv_format in HEAD_MAJOR_FORMATS and len(per_head) == 1 \
                and all(s.block_bytes % remote.kv_heads == 0 for s in remote.segments):
            (head_bytes,) = per_head
            self._slice_off = src_head * head_bytes
            self._staged_src_head = 0
            self._seg_bytes = [nheads * head_bytes] * len(remote.segments)
            self._src_geom = segment_geometry(dataclasses.replace(remote, kv_heads=nheads))
        # Each reader (segment, part, heads) and the holder (segment, part, heads) with the same
        # layer's K or V (or latent) and heads, grouped by what one scatter_tokens call can take:
        # one reader region, one part pair (rows carry their own heads). A reader segment fed part
        # for part by one holder segment (same format family, e.g. cpu -> cpu at another block
        # size) goes as a whole, all parts in one call: the kernel then copies a cpu head's K^T
        # and V together, which is faster than two passes.
        theirs = _head_parts(remote, segment_geometry(remote))
        staged_shift = src_head - self._staged_src_head  # holder head h is staged head h - shift
        per_local: dict[int, list[list[int]]] = {}  # reader segment -> [[its part, seg_r, part_r, hr, hl, n]]
        for (layer, which, head), (seg_l, part_l, hl) in sorted(_head_parts(local, self._dst_geom).items()):
            if not dst_head <= head < dst_head + nheads:
                continue
            seg_r, part_r, hr = theirs[(layer, which, head - dst_head + src_head)]
            if remote.segments[seg_r].head < 0:
                hr -= staged_shift
            entries = per_local.setdefault(seg_l, [])
            last = entries[-1] if entries else None
            if last and last[:3] == [part_l, seg_r, part_r] and last[3] + last[5] == hr and last[4] + last[5] == hl:
                last[5] += 1
            else:
                entries.append([part_l, seg_r, part_r, hr, hl, 1])
        whole = len(self._src_geom.parts) == len(self._dst_geom.parts)
        # (reader region, holder part or None for all parts, reader part or None) ->
        # [(seg_r, seg_l, holder head, reader head, heads)]
        self._groups: dict[tuple[int, int | None, int | None], list[tuple[int, int, int, int, int]]] = {}
        for seg_l, entries in sorted(per_local.items()):
            region = local.segments[seg_l].region
            if whole and len({tuple(e[1:2] + e[3:]) for e in entries}) == 1 and all(e[0] == e[2] for e in entries) \
                    and len(entries) == len(self._dst_geom.parts):
                _, seg_r, _, hr, hl, n = entries[0]
                self._groups.setdefault((region, None, None), []).append((seg_r, seg_l, hr, hl, n))
                continue
            for part_l, seg_r, part_r, hr, hl, n in entries:
                self._groups.setdefault((region, part_r, part_l), []).append((seg_r, seg_l, hr, hl, n))
        self._stage_base = np.cumsum([0] + self._seg_bytes[:-1], dtype=np.int64)  # per staged block

    @property
    def remote_block_size(self) -> int:
        return self.remote.block_size

    def staging_bytes(self, nblocks: int) -> int:
        return nblocks * sum(self._seg_bytes)

    def read(self, remote_blocks: Sequence[int], remote_first_token: int, local_blocks: Sequence[int],
             local_first_token: int, start: int, ntokens: int, staging_offset: int) -> StagedRead:
        """The READ of ``remote_blocks`` (whole, or their head slice) into staging at
        ``staging_offset``, and what to scatter from there once it landed."""
        self.remote.check_blocks(remote_blocks, "remote")
        self.local.check_blocks(local_blocks, "local")
        n = len(remote_blocks)
        if ntokens <= 0 or start < remote_first_token or start + ntokens > remote_first_token + n * self.remote.block_size:
            raise LayoutError(f"tokens [{start}, {start + ntokens}) are not inside the staged holder blocks "
                              f"from token {remote_first_token}")
        if start < local_first_token or start + ntokens > local_first_token + len(local_blocks) * self.local.block_size:
            raise LayoutError(f"tokens [{start}, {start + ntokens}) are not inside the reader's {len(local_blocks)} "
                              f"blocks from token {local_first_token}")
        runs = []
        off = staging_offset
        for seg, nbytes in zip(self.remote.segments, self._seg_bytes):
            for i, b in enumerate(remote_blocks):
                runs.append(TransferRun(seg.region, seg.block_offset(int(b)) + self._slice_off, self.staging_region,
                                        off + i * nbytes, nbytes))
            off += n * nbytes
        plan = TransferPlan(tuple(coalesce(runs)), len(runs))
        return StagedRead(plan, staging_offset, self.staging_bytes(n), remote_first_token,
                          tuple(int(b) for b in local_blocks), local_first_token, start, ntokens)

    def read_pairs(self, remote_blocks: Sequence[int], local_blocks: Sequence[int], staging_offset: int) -> StagedRead:
        """Block for block (equal block sizes, another format or head split): holder block
        ``remote_blocks[i]`` whole into reader block ``local_blocks[i]``, like PeerPlanner.plan's
        pairs. Token positions only matter within a block, so the pairs are treated as one sequence."""
        if self.remote.block_size != self.local.block_size:
            raise LayoutError(f"read_pairs needs equal block sizes, holder has {self.remote.block_size}, this "
                              f"reader {self.local.block_size}; use read() with token positions")
        if len(remote_blocks) != len(local_blocks) or not remote_blocks:
            raise LayoutError(f"{len(remote_blocks)} remote blocks but {len(local_blocks)} local blocks")
        return self.read(remote_blocks, 0, local_blocks, 0, 0, len(remote_blocks) * self.local.block_size,
                         staging_offset)

    def scatter_calls(self, job: StagedRead) -> list[ScatterCall]:
        """The kernel calls that copy the job's token range and heads from staging into the
        reader's blocks, every layer, K and V: one per (reader region, holder part, reader part),
        or per reader region where segments pair whole. :meth:`scatter` runs them on the host;
        device operations enqueue the same calls on a stream."""
        n = job.staging_bytes // sum(self._seg_bytes)  # staged holder blocks
        # Runs in block indices once; each segment pair only swaps in its byte offsets and heads.
        proto = token_runs(np.arange(n, dtype=np.int64), self.remote.block_size,
                           np.arange(len(job.local_blocks), dtype=np.int64), self.local.block_size, job.ntokens,
                           src_start=job.start - job.remote_first_token, dst_start=job.start - job.local_first_token,
                           src_head=self._staged_src_head, dst_head=self.dst_head, nheads=self.nheads)
        src_idx, dst_idx = proto[:, 0].copy(), proto[:, 1].copy()
        local_blocks = np.asarray(job.local_blocks, dtype=np.int64)
        calls = []
        for (region, part_r, part_l), pairs in self._groups.items():
            chunks = []
            for seg_r, seg_l, hr, hl, nh in pairs:
                runs = proto.copy()
                runs[:, 0] = job.staging_offset + self._stage_base[seg_r] * n + src_idx * self._seg_bytes[seg_r]
                ls = self.local.segments[seg_l]
                runs[:, 1] = ls.base + local_blocks[dst_idx] * ls.block_stride
                runs[:, 5], runs[:, 6], runs[:, 7] = hr, hl, nh
                chunks.append(runs)
            src_geom = self._src_geom if part_r is None else self._src_geom.select(part_r)
            dst_geom = self._dst_geom if part_l is None else self._dst_geom.select(part_l)
            calls.append(ScatterCall(region, np.concatenate(chunks), src_geom, dst_geom, self._elem))
        return calls

    def scatter(self, job: StagedRead, staging: native.RawBuffer, regions: Sequence[native.RawBuffer]) -> None:
        """Run :meth:`scatter_calls` with the native kernels, on the caller's thread."""
        for c in self.scatter_calls(job):
            native.scatter_tokens(staging, regions[c.region], c.runs, c.src_geom, c.dst_geom,
                                  elem_size=c.elem_size)


def planner_for(remote: KVLayout, local: KVLayout, staging_region: int | None, *, src_head: int = 0,
                dst_head: int = 0, nheads: int | None = None) -> PeerPlanner | ConvertingPlanner:
    """The planner for one holder (rank), chosen at connect: straight into place where bytes need
    no rearranging (same byte format and block size, all heads; or a head slice of head-major
    blocks of equal size), else staged and scattered. ``staging_region`` None: no staging area,
    so only direct reads are possible (a LayoutError says why not)."""
    heads = dict(src_head=src_head, dst_head=dst_head, nheads=nheads)
    try:
        return PeerPlanner(remote, local, **heads)
    except LayoutError as direct:
        if staging_region is None:
            raise LayoutError(f"{direct}; and there is no staging area to convert through") from direct
    return ConvertingPlanner(remote, local, staging_region, **heads)


class StagingArea:
    """First-fit allocation of a registered staging region among concurrent loads."""

    def __init__(self, nbytes: int, align: int = 4096) -> None:
        self.nbytes = nbytes
        self._align = align
        self._lock = threading.Lock()
        self._used: dict[int, int] = {}  # offset -> size

    def alloc(self, size: int) -> int | None:
        """An offset with ``size`` free bytes, or None when the area is too full now. ``size``
        must be positive: an empty range would share an offset with another load's range, and
        freeing it would drop that load's reservation."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"staging allocation size must be a positive int, got {size!r}")
        size = -(-size // self._align) * self._align
        with self._lock:
            at = 0
            for off in sorted(self._used):
                if off - at >= size:
                    break
                at = off + self._used[off]
            if at + size > self.nbytes:
                return None
            self._used[at] = size
            return at

    def alloc_upto(self, unit: int, units: int) -> tuple[int, int] | None:
        """(offset, n): ``n`` (1 <= n <= ``units``) consecutive ``unit``-byte pieces in the largest
        free gap, as many as fit; None when not even one fits now."""
        if isinstance(unit, bool) or not isinstance(unit, int) or unit <= 0 or units <= 0:
            raise ValueError(f"staging allocation of {units} x {unit!r} bytes: both must be positive")
        with self._lock:
            best_at, best_gap, at = 0, 0, 0
            for off in sorted(self._used) + [self.nbytes]:
                if off - at > best_gap:
                    best_at, best_gap = at, off - at
                if off < self.nbytes:
                    at = max(at, off + self._used[off])
            n = min(units, best_gap // unit)
            while n > 0 and -(-n * unit // self._align) * self._align > best_gap:
                n -= 1
            if n <= 0:
                return None
            self._used[best_at] = -(-n * unit // self._align) * self._align
            return best_at, n

    def free(self, offset: int) -> None:
        with self._lock:
            self._used.pop(offset, None)

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())


__all__ = ["ConvertingPlanner", "ScatterCall", "StagedRead", "StagingArea", "check_convertible", "planner_for"]
