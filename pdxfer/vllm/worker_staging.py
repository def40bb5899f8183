"""The worker's staging area for holders whose block size differs from ours (see
:mod:`pdxfer.convert`): registered with the transport next to the KV regions, shared by
concurrent loads, freed only when a load's reads have stopped."""

from __future__ import annotations

from typing import Any

import numpy as np

from pdxfer import native
from pdxfer.convert import ConvertingPlanner, StagedRead, StagingArea, planner_for
from pdxfer.layout import KVLayout
from pdxfer.plan import PeerPlanner
from pdxfer.transport.base import RegisteredRegion


class StagingFull(RuntimeError):
    """Concurrent converting loads already use the whole staging area: this one is recomputed."""


def _check_not_empty(r: Any) -> None:
    # Refused before anything is reserved: only non-empty reads own a staging range.
    if not r.remote_blocks or not r.local_blocks:
        raise ValueError(f"a staged read from {r.node_id} names no holder blocks or no local blocks "
                         f"({len(r.remote_blocks)} and {len(r.local_blocks)})")


class ReaderStaging:
    def __init__(self, mib: int, layout: KVLayout) -> None:
        self.layout = layout
        self.region_index = len(layout.regions)
        # np.zeros maps lazily: untouched staging costs no memory.
        self._mem = np.zeros(max(mib, 0) << 20, dtype=np.uint8)
        self._buf = native.RawBuffer(self._mem.ctypes.data, self._mem.nbytes)
        self._regions = [native.RawBuffer(r.ptr, r.nbytes) for r in layout.regions]
        self.area = StagingArea(self._mem.nbytes)

    @property
    def enabled(self) -> bool:
        return self._mem.nbytes > 0

    def region(self) -> RegisteredRegion:
        return RegisteredRegion(self.region_index, self._mem.ctypes.data, self._mem.nbytes)

    def planner_for(self, remote: KVLayout, route: Any) -> PeerPlanner | ConvertingPlanner:
        """Checked once per holder rank at connect, for ``route``'s heads
        (:mod:`pdxfer.vllm.holder_routes`): straight into place where the bytes need no
        rearranging, else staged and converted (another block size, format or head arrangement)."""
        return planner_for(remote, self.layout, self.region_index if self.enabled else None,
                           src_head=route.src_head, dst_head=route.dst_head, nheads=route.nheads)

    def start(self, planner: ConvertingPlanner, r: Any) -> StagedRead:
        """Room in staging for one token-range read (a NodeRead with a holder block size)."""
        _check_not_empty(r)
        off = self.area.alloc(planner.staging_bytes(len(r.remote_blocks)))
        if off is None:
            raise StagingFull(f"staging area ({self._mem.nbytes >> 20} MiB) is full; raise staging_mib")
        try:
            return planner.read(r.remote_blocks, r.remote_first_token, r.local_blocks, r.local_first_token,
                                r.start, r.num_tokens, off)
        except Exception:
            self.area.free(off)
            raise

    def start_pairs(self, planner: ConvertingPlanner, r: Any) -> StagedRead:
        """Room in staging for block-for-block pairs converted on the way (another format or a
        head slice at the same block size: a NodeRead without a holder block size)."""
        _check_not_empty(r)
        off = self.area.alloc(planner.staging_bytes(len(r.remote_blocks)))
        if off is None:
            raise StagingFull(f"staging area ({self._mem.nbytes >> 20} MiB) is full; raise staging_mib")
        try:
            return planner.read_pairs(r.remote_blocks, r.local_blocks, off)
        except Exception:
            self.area.free(off)
            raise

    def scatter(self, jobs: list[tuple[ConvertingPlanner, StagedRead]]) -> None:
        """The staged bytes landed: copy each job's tokens into our blocks."""
        for planner, job in jobs:
            planner.scatter(job, self._buf, self._regions)

    def release(self, jobs: list[tuple[ConvertingPlanner, StagedRead]]) -> None:
        """Only once no read of these jobs can land any more."""
        for _, job in jobs:
            self.area.free(job.staging_offset)
        jobs.clear()
