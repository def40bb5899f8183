"""The worker's staging area for holders whose blocks differ from ours (see
:mod:`pdxfer.planning.convert`): registered with the transport next to the KV regions, shared by
concurrent loads, a range given back only once no read can land in it any more.

A staged read (one holder rank's part of a load) is a :class:`StagedStream`: its holder blocks
are READ and scattered piece by piece, each piece as many holder blocks as there is room for
(at most half the area once the whole read does not fit, so concurrent loads get room too), the
next piece posted only once the previous one was scattered and its range freed. A load longer
than the whole area therefore still moves; only a single holder block larger than the area
cannot (:class:`StagingTooSmall`).

A failed load whose read never stopped (its transport broke its own bound) leaves its ranges
quarantined: out of use until the read stops, or a grace period after the worker disconnected
its holder, so a late byte of it can never land in the next load's staged bytes.

The area lives where the KV blocks do (:func:`pdxfer.device.device_ops_for` of their device):
device memory on a GPU, host memory on CPU. A piece's scatter is enqueued on the worker's own
stream with an event after it; the piece's range is given back, and its load can finish, only
once that event completed (a :class:`ScatterHandle` stands in the load's handles meanwhile).
With the default, synchronous CPU stand-in the scatter runs at once on the caller's thread, as
it always did.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from pdxfer.device import native
from pdxfer.planning.convert import ConvertingPlanner, StagedRead, StagingArea, planner_for
from pdxfer.device import CpuStandIn, DeviceError, DeviceEvent, DeviceOps, device_ops_for, flat_bytes
from pdxfer.kv.layout import KVLayout
from pdxfer.planning.peer_plan import PeerPlanner
from pdxfer.transport.base import ReadHandle, ReadState, RegisteredRegion, TransferTimeout

log = logging.getLogger("pdxfer.vllm.worker")

MiB = 1 << 20
# Headroom of the size chosen from the model: staged reads round out to whole holder blocks at
# both ends (holder blocks up to this many tokens), and a second load may convert meanwhile.
_ROUNDING_TOKENS = 1024
_MIN_AUTO_BYTES = 16 * MiB
# A quarantined range whose peer was disconnected is given back after this: bytes the transport
# was copying at the disconnect have landed by then.
QUARANTINE_GRACE_S = 2.0


class StagingFull(RuntimeError):
    """Concurrent converting loads used the whole staging area for longer than a load may wait."""


class StagingTooSmall(RuntimeError):
    """One holder block does not fit in the whole staging area: no piece can ever be staged."""


def auto_staging_bytes(layout: KVLayout, total_kv_heads: int, max_tokens: int, cap_mib: int) -> int:
    """Staging for one converting load of ``max_tokens`` (the model's max length) plus headroom,
    at most ``cap_mib`` MiB: longer loads stream through it in pieces. Per token, the worst case
    is staging whole holder blocks that carry every KV head of the model (a TP 1 holder in a
    format that interleaves heads, for a TP rank that keeps only some of them)."""
    per_token = layout.bytes_per_block / layout.block_size
    per_token *= max(1.0, total_kv_heads / max(1, layout.kv_heads))
    need = int(per_token * (max(0, max_tokens) + _ROUNDING_TOKENS) * 1.25)
    need = max(need, _MIN_AUTO_BYTES)
    return min(-(-need // MiB) * MiB, max(0, cap_mib) * MiB)


@dataclass(frozen=True)
class _Piece:
    """Arguments of ConvertingPlanner.read for one piece of a staged read."""

    remote_blocks: tuple[int, ...]
    remote_first_token: int
    local_blocks: tuple[int, ...]
    local_first_token: int
    start: int
    ntokens: int


@dataclass
class StagedStream:
    """One staged read: its holder blocks in order, the piece in staging now (``job``)."""

    planner: ConvertingPlanner
    peer: str  # the transport peer the pieces are read from
    read: Any  # the NodeRead
    pairs: bool  # block for block (no holder block size in the read)
    first: int  # index into read.remote_blocks of the first block with a token to move
    end: int  # one past the last such block
    next: int  # first block not yet staged
    job: StagedRead | None = None
    scatter_event: DeviceEvent | None = None  # after the job's scatter; its range is busy until it completed
    waiting_since: float = 0.0  # monotonic; 0: not waiting for room
    pieces: int = 0

    @property
    def finished(self) -> bool:
        return self.job is None and self.next >= self.end

    @property
    def unit(self) -> int:
        return self.planner.staging_bytes(1)

    def remaining_bytes(self) -> int:
        return self.planner.staging_bytes(self.end - self.next)

    def piece(self, a: int, b: int) -> _Piece:
        """Holder blocks [a, b) of the read, with the reader blocks their tokens go to."""
        r = self.read
        if self.pairs:
            return _Piece(tuple(r.remote_blocks[a:b]), 0, tuple(r.local_blocks[a:b]), 0, 0,
                          (b - a) * self.planner.local.block_size)
        hb, lb = self.planner.remote.block_size, self.planner.local.block_size
        t0 = max(r.start, r.remote_first_token + a * hb)
        t1 = min(r.start + r.num_tokens, r.remote_first_token + b * hb)
        la = (t0 - r.local_first_token) // lb
        le = -(-(t1 - r.local_first_token) // lb)
        return _Piece(tuple(r.remote_blocks[a:b]), r.remote_first_token + a * hb, tuple(r.local_blocks[la:le]),
                      r.local_first_token + la * lb, t0, t1 - t0)


@dataclass
class _Quarantined:
    offsets: list[int]
    handles: list[ReadHandle]
    since: float
    disconnected: bool  # the peers of every unstopped read were disconnected at ``since``
    what: str

    def releasable(self, now: float) -> bool:
        if any(isinstance(h, ScatterHandle) and not _stopped(h) for h in self.handles):
            return False  # a kernel still reads the range: no grace period makes it stop
        if all(_stopped(h) for h in self.handles):
            return True
        return self.disconnected and now - self.since >= QUARANTINE_GRACE_S


def _stopped(h: ReadHandle) -> bool:
    try:
        return h.poll() is not ReadState.PENDING
    except Exception:
        return False


def _check_not_empty(r: Any) -> None:
    # Refused before anything is reserved: only non-empty reads own a staging range.
    if not r.remote_blocks or not r.local_blocks:
        raise ValueError(f"a staged read from {r.node_id} names no holder blocks or no local blocks "
                         f"({len(r.remote_blocks)} and {len(r.local_blocks)})")


class ScatterHandle(ReadHandle):
    """Stands in a load's handles for a staged piece whose scatter was enqueued and has not been
    seen complete: the load is not finished, and a failed one not reported, while it runs (the
    kernel still writes into our blocks and reads the piece's range)."""

    def __init__(self, event: DeviceEvent, device: str) -> None:
        self.event = event
        self.device = device

    def poll(self) -> ReadState:
        if not self.event.query():
            return ReadState.PENDING
        return ReadState.FAILED if self.event.error is not None else ReadState.DONE

    def wait(self, timeout: float) -> ReadState:
        if not self.event.wait(timeout):
            raise TransferTimeout(f"scatter from staging on {self.device} still running after {timeout:.2f} s")
        if self.error is not None:
            raise self.error
        return ReadState.DONE

    def cancel(self) -> None:
        pass  # enqueued device work cannot be taken back; poll says when it ended

    @property
    def error(self) -> DeviceError | None:
        why = self.event.error if self.event.query() else None
        return None if why is None else DeviceError(f"scatter from staging on {self.device} failed: {why}")


def _device_of(layout: KVLayout) -> str:
    devices = sorted({r.device for r in layout.regions}) or ["cpu"]
    if len(devices) > 1:
        raise ValueError(f"the KV regions are on several devices ({', '.join(devices)}); one staging area "
                         "cannot serve them")
    return devices[0]


def region_tensors(kv_caches: Mapping[str, Any], layout: KVLayout) -> list[torch.Tensor]:
    """Each of ``layout``'s regions as the flat uint8 tensor of its storage (what device
    operations address), from the KV tensors it was described from."""
    by_ptr = {}
    for t in kv_caches.values():
        by_ptr.setdefault(t.untyped_storage().data_ptr(), t)
    out = []
    for r in layout.regions:
        t = by_ptr.get(r.ptr)
        if t is None:
            raise ValueError(f"region {r.index} ({r.nbytes} bytes at {r.ptr:#x}) is none of the KV tensors' storage")
        out.append(flat_bytes(t))
    return out


class ReaderStaging:
    """``kv_regions``: the layout's regions as flat uint8 tensors (:func:`region_tensors`),
    needed on a GPU; on CPU they default to views of the regions' memory. ``ops``: the device
    operations (default: those of the regions' device)."""

    def __init__(self, nbytes: int, layout: KVLayout, kv_regions: Sequence[torch.Tensor] | None = None,
                 ops: DeviceOps | None = None) -> None:
        self.layout = layout
        self.region_index = len(layout.regions)
        self.ops = ops if ops is not None else device_ops_for(_device_of(layout))
        nbytes = max(int(nbytes), 0)
        self._mem: np.ndarray | None = None
        if self.ops.is_gpu:
            self._mem_t = self.ops.alloc(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8,
                                                                            device=self.ops.device)
        else:
            # np.zeros maps lazily: untouched staging costs no memory.
            self._mem = np.zeros(nbytes, dtype=np.uint8)
            self._mem_t = torch.from_numpy(self._mem)
        self._buf = native.RawBuffer(self._mem_t.data_ptr() if nbytes else 0, nbytes)
        self._regions = [native.RawBuffer(r.ptr, r.nbytes) for r in layout.regions]
        self._region_t = self._checked_regions(kv_regions) if kv_regions is not None else None
        if self.ops.is_gpu and self._region_t is None:
            raise ValueError(f"staging on {self.ops.device} needs the KV regions as tensors (kv_regions)")
        # The synchronous stand-in scatters on the caller's thread exactly as before devices
        # existed; everything else enqueues on a stream of the worker's own.
        self._inline = isinstance(self.ops, CpuStandIn) and not self.ops.asynchronous
        self._stream = None if self._inline or not nbytes else self.ops.new_stream()
        self.area = StagingArea(nbytes)
        self._quarantine: list[_Quarantined] = []

    def _checked_regions(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        if len(tensors) != len(self.layout.regions):
            raise ValueError(f"{len(tensors)} region tensors for {len(self.layout.regions)} KV regions")
        for r, t in zip(self.layout.regions, tensors):
            if (t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != r.nbytes or t.data_ptr() != r.ptr
                    or str(t.device) != r.device):
                raise ValueError(f"region tensor {r.index} ({t.dtype} {tuple(t.shape)} on {t.device}) is not "
                                 f"region {r.index} ({r.nbytes} bytes on {r.device}) as flat bytes")
        return tensors

    def _region_tensors(self) -> list[torch.Tensor]:
        if self._region_t is None:  # CPU: the regions' own memory
            self._region_t = [native._bytes_view(r.ptr, r.nbytes) for r in self.layout.regions]
        return self._region_t

    @property
    def enabled(self) -> bool:
        return self.nbytes > 0

    @property
    def nbytes(self) -> int:
        return int(self._mem_t.numel())

    @property
    def device(self) -> str:
        return self.ops.device

    def region(self) -> RegisteredRegion:
        return RegisteredRegion(self.region_index, self._buf.ptr, self.nbytes, self.ops.device, tensor=self._mem_t)

    def planner_for(self, remote: KVLayout, route: Any) -> PeerPlanner | ConvertingPlanner:
        """Checked once per holder rank at connect, for ``route``'s heads
        (:mod:`pdxfer.vllm.holder_routes`): straight into place where the bytes need no
        rearranging, else staged and converted (another block size, format or head arrangement)."""
        return planner_for(remote, self.layout, self.region_index if self.enabled else None,
                           src_head=route.src_head, dst_head=route.dst_head, nheads=route.nheads)

    # ------------------------------------------------------------------ streams

    def stream(self, planner: ConvertingPlanner, r: Any, peer: str) -> StagedStream:
        """A staged read of NodeRead ``r``: a token range when it names the holder's block size,
        else block-for-block pairs (another format or a head slice at the same block size).
        Nothing is reserved yet (:meth:`next_piece` does)."""
        _check_not_empty(r)
        if r.remote_block_size:
            if r.remote_block_size != planner.remote.block_size:
                raise ValueError(f"read from {r.node_id} says holder block size {r.remote_block_size}, "
                                 f"its layout {planner.remote.block_size}")
            hb = planner.remote.block_size
            if r.num_tokens <= 0 or r.start < r.remote_first_token:
                raise ValueError(f"read from {r.node_id}: tokens [{r.start}, {r.start + r.num_tokens}) do not "
                                 f"start in its holder blocks (from token {r.remote_first_token})")
            first = (r.start - r.remote_first_token) // hb
            end = min(len(r.remote_blocks), -(-(r.start + r.num_tokens - r.remote_first_token) // hb))
            s = StagedStream(planner, peer, r, False, first, end, first)
        else:
            if len(r.remote_blocks) != len(r.local_blocks):
                raise ValueError(f"read from {r.node_id}: {len(r.remote_blocks)} holder blocks for "
                                 f"{len(r.local_blocks)} local blocks")
            s = StagedStream(planner, peer, r, True, 0, len(r.remote_blocks), 0)
        if s.unit > self.nbytes:
            raise StagingTooSmall(f"one holder block of {r.node_id} stages {s.unit} bytes, more than the whole "
                                  f"staging area ({self.nbytes} bytes); raise staging_mib")
        return s

    def next_piece(self, s: StagedStream) -> StagedRead | None:
        """Reserve room for the stream's next piece and plan its READ; None while there is no room
        for even one holder block (other loads use the area: try again later)."""
        assert s.job is None and not s.finished
        left = s.end - s.next
        if s.remaining_bytes() > self.nbytes:  # streaming: leave room for other loads
            left = min(left, max(1, (self.nbytes // 2) // s.unit))
        got = self.area.alloc_upto(s.unit, left)
        if got is None:
            return None
        off, n = got
        p = s.piece(s.next, s.next + n)
        try:
            if s.pairs:
                job = s.planner.read_pairs(p.remote_blocks, p.local_blocks, off)
            else:
                job = s.planner.read(p.remote_blocks, p.remote_first_token, p.local_blocks, p.local_first_token,
                                     p.start, p.ntokens, off)
        except Exception:
            self.area.free(off)
            raise
        s.job, s.next, s.pieces = job, s.next + n, s.pieces + 1
        return job

    def start_scatter(self, s: StagedStream) -> DeviceEvent:
        """The stream's piece landed: enqueue the copy of its tokens into our blocks; returns
        the event after it (also ``s.scatter_event``, set even when enqueuing failed part way,
        so whatever was enqueued is waited for). The range stays reserved until
        :meth:`finish_scatter`."""
        assert s.job is not None and s.scatter_event is None
        if self._inline:
            s.planner.scatter(s.job, self._buf, self._regions)
            s.scatter_event = self.ops.record_event(self.ops.current_stream())
            return s.scatter_event
        regions = self._region_tensors()
        calls = s.planner.scatter_calls(s.job)
        for c in calls:  # all checked before any is enqueued
            native.check_scatter_tokens(self._mem_t, regions[c.region], c.runs, c.src_geom, c.dst_geom,
                                        elem_size=c.elem_size)
        try:
            for c in calls:
                self.ops.scatter_tokens(self._mem_t, regions[c.region], c.src_geom, c.dst_geom, c.runs,
                                        self._stream, elem_size=c.elem_size)
        finally:
            s.scatter_event = self.ops.record_event(self._stream)
        return s.scatter_event

    def finish_scatter(self, s: StagedStream) -> None:
        """Once ``s.scatter_event`` completed: give the piece's range back. DeviceError when the
        device reported the scatter failed (the range is then released with the load)."""
        ev = s.scatter_event
        assert s.job is not None and ev is not None and ev.query()
        if ev.error is not None:
            raise DeviceError(f"scatter from staging on {self.ops.device} failed: {ev.error}")
        self.area.free(s.job.staging_offset)
        s.job, s.scatter_event = None, None

    def scatter(self, s: StagedStream) -> bool:
        """:meth:`start_scatter`, then :meth:`finish_scatter` if it already completed (always,
        with the synchronous stand-in); True when the range was given back."""
        if not self.start_scatter(s).query():
            return False
        self.finish_scatter(s)
        return True

    def release(self, streams: list[StagedStream]) -> None:
        """Only once no read of these streams can land any more."""
        for s in streams:
            if s.job is not None:
                self.area.free(s.job.staging_offset)
                s.job, s.scatter_event = None, None
        streams.clear()

    # ------------------------------------------------------------------ quarantine

    def quarantine(self, streams: list[StagedStream], handles: list[ReadHandle], disconnected: bool,
                   what: str) -> int:
        """Keep the ranges of reads that may still land out of use: until every one of
        ``handles`` stopped, or, where their peers were ``disconnected``, a grace period after.
        Returns the bytes kept out."""
        offsets = [s.job.staging_offset for s in streams if s.job is not None]
        held = sum(s.job.staging_bytes for s in streams if s.job is not None)
        for s in streams:
            s.job, s.scatter_event = None, None
        streams.clear()
        if offsets:
            self._quarantine.append(_Quarantined(offsets, list(handles), time.monotonic(), disconnected, what))
        return held

    def sweep(self) -> None:
        """Give back quarantined ranges no read can land in any more (called every step)."""
        if not self._quarantine:
            return
        now = time.monotonic()
        keep = []
        for q in self._quarantine:
            if q.releasable(now):
                for off in q.offsets:
                    self.area.free(off)
                log.info("pdxfer: staging range(s) of %s are in use again (%s)", q.what,
                         "its reads stopped" if all(_stopped(h) for h in q.handles)
                         else f"{QUARANTINE_GRACE_S:.0f} s after its holder was disconnected")
            else:
                keep.append(q)
        self._quarantine = keep

    @property
    def quarantined(self) -> int:
        """Quarantined ranges (loads' worth) still out of use."""
        return len(self._quarantine)
