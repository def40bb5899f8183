"""Moving KV between holders and readers whose block sizes differ.

A block is opaque bytes and, in vLLM's CPU layout, tokens are not contiguous inside it (K is
stored transposed), so a token range cannot be READ straight into blocks of another size. The
reader READs the holder's whole blocks into a registered *staging* area instead, then scatters
the token range into its own blocks with the native kernels (``pdxfer.native.scatter_tokens``,
threaded C++; a torch path where the library is absent). Same-size blocks never come here:
they are READ straight into place (:class:`pdxfer.plan.PeerPlanner`).

Staging layout of one read: for segment ``s`` (layer, or K/V of a layer) and staged holder block
``i``: ``offset + seg_offset[s] + i * seg_block_bytes[s]`` inside the staging region.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdxfer import native
from pdxfer.blockgeom import segment_geometry, token_runs
from pdxfer.layout import KVLayout, LayoutError
from pdxfer.plan import TransferPlan, TransferRun, coalesce

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1,
                "int8": 1}


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


class ConvertingPlanner:
    """Plans from one holder whose block size differs from the reader's (same byte format
    otherwise); made once per holder at connect, like PeerPlanner. Refuses, naming both sides,
    what it cannot convert."""

    def __init__(self, remote: KVLayout, local: KVLayout, staging_region: int) -> None:
        mine = (local.kv_format, local.dtype, local.num_layers, local.kv_heads, local.head_dim)
        theirs = (remote.kv_format, remote.dtype, remote.num_layers, remote.kv_heads, remote.head_dim)
        if mine != theirs:
            raise LayoutError(f"cannot convert KV blocks: holder has (format, dtype, layers, kv heads, head "
                              f"dim) {theirs}, this reader {mine}")
        if [(s.layer, s.part) for s in remote.segments] != [(s.layer, s.part) for s in local.segments]:
            raise LayoutError("cannot convert KV blocks: holder and reader name their layers differently")
        try:
            self._src_geom = segment_geometry(remote)
            self._dst_geom = segment_geometry(local)
        except ValueError as exc:
            raise LayoutError(f"cannot convert KV blocks of format {remote.kv_format}: {exc}") from exc
        if local.dtype not in _DTYPE_BYTES:
            raise LayoutError(f"cannot convert KV blocks of dtype {local.dtype}")
        self.remote = remote
        self.local = local
        self.staging_region = staging_region
        self._elem = _DTYPE_BYTES[local.dtype]
        self._seg_bytes = [s.block_bytes for s in remote.segments]

    @property
    def remote_block_size(self) -> int:
        return self.remote.block_size

    def staging_bytes(self, nblocks: int) -> int:
        return nblocks * sum(self._seg_bytes)

    def read(self, remote_blocks: Sequence[int], remote_first_token: int, local_blocks: Sequence[int],
             local_first_token: int, start: int, ntokens: int, staging_offset: int) -> StagedRead:
        """The READ of ``remote_blocks`` (whole) into staging at ``staging_offset``, and what to
        scatter from there once it landed."""
        self.remote.check_blocks(remote_blocks, "remote")
        self.local.check_blocks(local_blocks, "local")
        n = len(remote_blocks)
        if ntokens <= 0 or start < remote_first_token or start + ntokens > remote_first_token + n * self.remote.block_size:
            raise LayoutError(f"tokens [{start}, {start + ntokens}) are not inside the staged holder blocks "
                              f"from token {remote_first_token}")
        runs = []
        off = staging_offset
        for seg, nbytes in zip(self.remote.segments, self._seg_bytes):
            for i, b in enumerate(remote_blocks):
                runs.append(TransferRun(seg.region, seg.block_offset(int(b)), self.staging_region,
                                        off + i * nbytes, nbytes))
            off += n * nbytes
        plan = TransferPlan(tuple(coalesce(runs)), len(runs))
        return StagedRead(plan, staging_offset, self.staging_bytes(n), remote_first_token,
                          tuple(int(b) for b in local_blocks), local_first_token, start, ntokens)

    def scatter(self, job: StagedRead, staging: native.RawBuffer, regions: Sequence[native.RawBuffer]) -> None:
        """Copy the job's token range from staging into the reader's blocks, every layer."""
        n = job.staging_bytes // sum(self._seg_bytes)  # staged holder blocks
        per_region: dict[int, list[np.ndarray]] = {}
        off = job.staging_offset
        for seg_r, seg_l, nbytes in zip(self.remote.segments, self.local.segments, self._seg_bytes):
            src = off + np.arange(n, dtype=np.int64) * nbytes
            dst = np.array([seg_l.block_offset(b) for b in job.local_blocks], dtype=np.int64)
            per_region.setdefault(seg_l.region, []).append(token_runs(
                src, self.remote.block_size, dst, self.local.block_size, job.ntokens,
                src_start=job.start - job.remote_first_token, dst_start=job.start - job.local_first_token,
                nheads=self.local.kv_heads))
            off += n * nbytes
        for region, parts in per_region.items():
            native.scatter_tokens(staging, regions[region], np.concatenate(parts), self._src_geom, self._dst_geom,
                                  elem_size=self._elem)


class StagingArea:
    """First-fit allocation of a registered staging region among concurrent loads."""

    def __init__(self, nbytes: int, align: int = 4096) -> None:
        self.nbytes = nbytes
        self._align = align
        self._lock = threading.Lock()
        self._used: dict[int, int] = {}  # offset -> size

    def alloc(self, size: int) -> int | None:
        """An offset with ``size`` free bytes, or None when the area is too full now."""
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

    def free(self, offset: int) -> None:
        with self._lock:
            self._used.pop(offset, None)

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())


__all__ = ["ConvertingPlanner", "StagedRead", "StagingArea"]
