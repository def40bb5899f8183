"""The worker's host-memory tier: a pinned host pool with the KV cache's block format, and the
copies of published blocks into it (``OffloadJob``).

The pool's layout (:func:`host_layout`) has the same format, dtype, heads and segments as the
device KV cache, so its fingerprint is the same and any reader that can read the device blocks
can read host slots; each segment is dense in one host region. Its regions list repeats the
worker's other registered regions (KV, staging) as placeholders so that the host region's index
in the layout is its index at the transport: a reader plans against it exactly as against the
device layout, and the run's region is the one the transport knows.

A job's copy must follow the KV writes of the steps that computed its blocks: the worker records
an event on the current (compute) stream when the job arrives and enqueues the copy on a stream
of its own only once that event completed (polled each step, never waited on), so nothing is
added to vLLM's compute stream and the step never blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from pdxfer.common.bounded_cache import ClearWhenFullCache
from pdxfer.device import DeviceEvent, DeviceOps
from pdxfer.kv.layout import KVLayout, LayoutError, Region, Segment
from pdxfer.transport.base import RegisteredRegion
from pdxfer.kv.tiers import HOST_LAYOUT_KEY
from pdxfer.vllm.metadata import OffloadJob

log = logging.getLogger("pdxfer.vllm.worker")


class HostTierError(RuntimeError):
    """The host tier cannot be set up as configured; the message names the size and why."""


# host_tier_mib "auto": this share of the memory the kernel says is available when the worker
# starts, split among the TP ranks (they run on one host). A quarter leaves the rest to the
# engine, the OS page cache and other instances that start later on the same host.
AUTO_HOST_SHARE = 0.25


def auto_host_tier_mib(tp_size: int, meminfo: str = "/proc/meminfo", share: float = AUTO_HOST_SHARE) -> int:
    """MiB of host tier per TP rank for ``host_tier_mib: "auto"``: ``share`` of MemAvailable over
    ``tp_size``. Refuses (naming the file) when the available memory cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    kib = int(rest.split()[0])
                    break
            else:
                raise ValueError("no MemAvailable line")
    except (OSError, ValueError, IndexError) as exc:
        raise HostTierError(f'host_tier_mib "auto" needs the available memory from {meminfo} ({exc}); '
                            f"set host_tier_mib to a size in MiB") from None
    return int(kib / 1024 * share / max(tp_size, 1))


def host_slots_for(host_tier_mib: int, bytes_per_block: int) -> int:
    """How many blocks ``host_tier_mib`` MiB hold; refuses a size that holds none."""
    if host_tier_mib <= 0:
        return 0
    slots = (int(host_tier_mib) << 20) // max(int(bytes_per_block), 1)
    if slots < 1:
        raise HostTierError(f"host_tier_mib={host_tier_mib} holds no KV block of this rank "
                            f"({bytes_per_block} bytes per block): raise it or set it to 0")
    return slots


def host_layout(device: KVLayout, num_slots: int, placeholders: Sequence[Region]) -> KVLayout:
    """The layout of ``num_slots`` host slots shaped like ``device``'s blocks. ``placeholders``:
    the regions registered before the pool (KV regions, staging), so the pool's region gets the
    next index."""
    if num_slots < 1:
        raise LayoutError(f"a host pool needs at least one slot, got {num_slots}")
    index = len(placeholders)
    segments = []
    offset = 0
    for s in device.segments:
        segments.append(Segment(s.layer, s.part, index, offset, s.block_bytes, s.block_bytes, s.head))
        offset += num_slots * s.block_bytes
    regions = tuple(Region(i, r.nbytes, r.device) for i, r in enumerate(placeholders)) + (Region(index, offset, "cpu"),)
    layout = replace(device, num_blocks=num_slots, regions=regions, segments=tuple(segments))
    layout.validate()
    if layout.fingerprint() != device.fingerprint():  # the fingerprint ignores placement only
        raise LayoutError(f"host layout {layout.fingerprint()} differs from the KV layout {device.fingerprint()}")
    return layout


@dataclass
class _Job:
    job: OffloadJob
    writes_done: DeviceEvent  # the compute stream's work when the job arrived
    copied: DeviceEvent | None = None  # after the copy, once enqueued


class HostPool:
    """``num_slots`` host slots for the KV regions ``kv_regions`` (flat uint8 tensors, the
    device layout's regions in order) of ``device``; ``region_index``: the pool's region index
    at the transport (after the KV regions and staging)."""

    def __init__(self, device: KVLayout, kv_regions: Sequence[torch.Tensor], num_slots: int,
                 placeholders: Sequence[Region], ops: DeviceOps) -> None:
        self.device_layout = device
        self.layout = host_layout(device, num_slots, placeholders)
        self.region_index = len(placeholders)
        self.num_slots = num_slots
        self.ops = ops
        self._kv = list(kv_regions)
        if len(self._kv) != len(device.regions):
            raise ValueError(f"{len(self._kv)} region tensors for {len(device.regions)} KV regions")
        nbytes = self.layout.regions[self.region_index].nbytes
        try:
            self.mem = ops.alloc_host_pinned(nbytes)
        except (RuntimeError, MemoryError) as exc:
            raise HostTierError(f"cannot allocate the host tier's {nbytes / 2**20:.0f} MiB of pinned host memory "
                                f"({num_slots} blocks): {exc}; lower host_tier_mib") from exc
        self._stream = ops.new_stream()
        self._jobs: list[_Job] = []
        # Job ids started (a step's metadata may be bound twice). Ids only grow and old ones
        # never come back, so forgetting them all when full costs nothing.
        self._seen: ClearWhenFullCache[int, bool] = ClearWhenFullCache(65536)

    @property
    def nbytes(self) -> int:
        return int(self.mem.numel())

    def region(self) -> RegisteredRegion:
        return RegisteredRegion(self.region_index, self.mem.data_ptr(), self.nbytes, "cpu")

    def slot_bytes(self, slot: int) -> bytes:
        """Every segment's bytes of host slot ``slot``, in segment order (tests, diagnostics)."""
        out = bytearray()
        for s in self.layout.segments:
            off = s.block_offset(slot)
            out += self.mem[off: off + s.block_bytes].numpy().tobytes()
        return bytes(out)

    def start(self, job: OffloadJob) -> None:
        """Take ``job``: its copy is enqueued once the compute stream's work so far completed."""
        if job.job_id in self._seen:
            return
        self._seen.put(job.job_id, True)
        self.device_layout.check_blocks(job.device_blocks, "offload")
        self.layout.check_blocks(job.host_slots, "host")
        if len(job.device_blocks) != len(job.host_slots):
            raise LayoutError(f"offload job {job.job_id}: {len(job.device_blocks)} blocks for "
                              f"{len(job.host_slots)} host slots")
        self._jobs.append(_Job(job, self.ops.record_event(self.ops.current_stream())))

    def poll(self) -> tuple[list[int], dict[int, str]]:
        """Jobs whose copy completed since the last poll, and those that failed (id -> why)."""
        done: list[int] = []
        failed: dict[int, str] = {}
        keep: list[_Job] = []
        for j in self._jobs:
            try:
                if j.copied is None:
                    if not j.writes_done.query():
                        keep.append(j)
                        continue
                    why = j.writes_done.error
                    if why:
                        raise RuntimeError(f"the step before it failed: {why}")
                    self._enqueue_copy(j.job)
                    j.copied = self.ops.record_event(self._stream)
                if not j.copied.query():
                    keep.append(j)
                    continue
                why = j.copied.error
                if why:
                    raise RuntimeError(why)
                done.append(j.job.job_id)
            except Exception as exc:
                log.warning("pdxfer: host copy of job %d failed: %s", j.job.job_id, exc)
                failed[j.job.job_id] = f"{type(exc).__name__}: {exc}"
        self._jobs = keep
        return done, failed

    def _enqueue_copy(self, job: OffloadJob) -> None:
        pairs = list(zip(job.device_blocks, job.host_slots))
        for dev, host in zip(self.device_layout.segments, self.layout.segments):
            src = self._kv[dev.region]
            for b, s, n in _runs(pairs, dev.block_stride, dev.block_bytes):
                self.ops.copy(self.mem, host.block_offset(s), src, dev.block_offset(b), n * dev.block_bytes,
                              self._stream)

    def pending(self) -> int:
        return len(self._jobs)


def _runs(pairs: list[tuple[int, int]], src_stride: int, block_bytes: int) -> list[tuple[int, int, int]]:
    """(first device block, first slot, count) of consecutive pairs: one copy each where the
    device blocks are dense (stride == block bytes) and both ids advance together."""
    out: list[tuple[int, int, int]] = []
    for b, s in pairs:
        if out and src_stride == block_bytes:
            b0, s0, n = out[-1]
            if b == b0 + n and s == s0 + n:
                out[-1] = (b0, s0, n + 1)
                continue
        out.append((b, s, 1))
    return out
