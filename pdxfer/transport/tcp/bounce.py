"""Device memory over TCP: the pieces both sides share.

A socket can only read and write host memory, so a CUDA region travels through a small pinned
host *bounce buffer*: a :class:`SlicePool` of a few fixed slices. The holder copies requested
bytes device -> slice and sends each slice once its copy event completed
(:mod:`pdxfer.transport.tcp.bounce_send`); the reader receives into slices and copies them
slice -> device (:mod:`pdxfer.transport.tcp.bounce_recv`). :func:`segment` cuts a request's runs
into the order they travel in: groups of host runs (sent or received in place, as before) and
device slices of at most ``slice_bytes``.

Deadlock freedom with a shared pool: a pipeline blocks on the pool only for its first slice,
before it commits to anything (the reader before sending its request, the holder before sending
the response header); after that it never waits for another pipeline's slice, it reuses its
own. So a pipeline that holds a slice always progresses given its peer does, and the pool hands
freed slices to waiters first-come first-served.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pdxfer.device import DeviceEvent, DeviceOps, DeviceStream, device_ops_for
from pdxfer.transport.base import RegisteredRegion, TransportError


@dataclass
class Slice:
    """One pinned slice: ``tensor`` for device copies, ``view`` (same bytes) for the socket."""

    index: int
    tensor: torch.Tensor
    view: memoryview


class _Waiter:
    __slots__ = ("slice", "event")

    def __init__(self) -> None:
        self.slice: Slice | None = None
        self.event = threading.Event()


class SlicePool:
    """``nslices`` pinned slices of ``slice_bytes`` each, allocated once."""

    def __init__(self, ops: DeviceOps, nslices: int, slice_bytes: int, what: str) -> None:
        try:
            mem = ops.alloc_host_pinned(nslices * slice_bytes)
        except Exception as exc:  # noqa: BLE001 - any allocator failure is the same story to a user
            raise TransportError(f"tcp transport: cannot allocate the {what} bounce buffer "
                                 f"({nslices} x {slice_bytes} bytes pinned) on {ops.device}: {exc}") from exc
        self.what = what
        self.slice_bytes = slice_bytes
        self._mem = mem
        self._lock = threading.Lock()
        self._free: list[Slice] = []
        for i in range(nslices):
            t = mem[i * slice_bytes:(i + 1) * slice_bytes]
            self._free.append(Slice(i, t, memoryview(t.numpy()).cast("B")))
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self.nslices = nslices
        self.peak_in_use = 0
        self.leaked = 0  # slices never returned because a copy into them did not finish in time

    def _took(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.nslices - self.leaked - len(self._free))

    def try_acquire(self) -> Slice | None:
        """A free slice now, or None (also when others wait: they come first)."""
        with self._lock:
            if self._waiters or not self._free:
                return None
            s = self._free.pop()
            self._took()
            return s

    def acquire(self, timeout: float) -> Slice | None:
        """A slice within ``timeout`` seconds (first come, first served), or None."""
        with self._lock:
            if not self._waiters and self._free:
                s = self._free.pop()
                self._took()
                return s
            w = _Waiter()
            self._waiters.append(w)
        w.event.wait(max(0.0, timeout))
        with self._lock:
            if w.slice is None:
                self._waiters.remove(w)
            return w.slice

    def release(self, s: Slice) -> None:
        with self._lock:
            if self._waiters:
                w = self._waiters.popleft()
                w.slice = s
                w.event.set()
            else:
                self._free.append(s)

    def release_after(self, s: Slice, events: Sequence[DeviceEvent], deadline: float) -> bool:
        """Return ``s`` once every copy into or out of it finished (wait until ``deadline``,
        monotonic). A slice whose copy is still running is never handed out again: it is kept
        out of the pool for good and False returned."""
        for ev in events:
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self.leaked += 1
                return False
        self.release(s)
        return True


@dataclass
class Segment:
    """Runs that travel back to back: host runs (``group`` None, moved in place) or one device
    slice of ``group`` (runs packed into the slice in order, ``nbytes`` <= slice size)."""

    group: int | None
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (region, offset, nbytes)
    nbytes: int = 0

    def add(self, region: int, offset: int, nbytes: int) -> None:
        if self.runs:
            r, o, n = self.runs[-1]
            if r == region and o + n == offset:  # contiguous: one copy / one buffer instead of two
                self.runs[-1] = (r, o, n + nbytes)
                self.nbytes += nbytes
                return
        self.runs.append((region, offset, nbytes))
        self.nbytes += nbytes


def segment(regions: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
            group_of: Sequence[int | None], slice_bytes: int) -> list[Segment]:
    """Cut a request's runs (payload order) into segments; a device run longer than what is left
    of a slice continues in the next one. Zero-length runs are skipped."""
    out: list[Segment] = []
    cur: Segment | None = None
    for r, o, n in zip(regions, offsets, lengths):
        if n <= 0:
            continue
        g = group_of[r]
        if g is None:
            if cur is None or cur.group is not None:
                cur = Segment(None)
                out.append(cur)
            cur.add(r, o, n)
            continue
        while n:
            if cur is None or cur.group != g or cur.nbytes == slice_bytes:
                cur = Segment(g)
                out.append(cur)
            take = min(n, slice_bytes - cur.nbytes)
            cur.add(r, o, take)
            o += take
            n -= take
    return out


class BounceStats:
    """Counters that show the pipeline at work (tests read them; cheap enough to keep always)."""

    FIELDS = ("d2h_slices", "d2h_staged_ahead", "d2h_overlapped", "h2d_slices", "h2d_overlapped")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._c[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def _region_tensor(r: RegisteredRegion) -> torch.Tensor:
    t = r.tensor
    if not isinstance(t, torch.Tensor):
        raise TransportError(f"tcp transport: region {r.index} is on {r.device} but carries no tensor: "
                             f"sockets reach host memory only, so a device region needs "
                             f"RegisteredRegion(tensor=flat uint8 view of its bytes) to be copied through")
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != r.nbytes:
        raise TransportError(f"tcp transport: region {r.index}: tensor must be flat uint8 of {r.nbytes} "
                             f"bytes (pdxfer.device.flat_bytes, sliced), got {t.dtype} {tuple(t.shape)}")
    return t


class DevicePlane:
    """The device regions of one registration: their tensors, the DeviceOps each is copied with
    (``ops`` if given, else :func:`pdxfer.device.device_ops_for` of its device), one copy stream
    per ops and direction (never vLLM's compute stream) and the two bounce pools, allocated when
    first used."""

    def __init__(self, regions: Sequence[RegisteredRegion], ops: DeviceOps | None, nslices: int,
                 slice_bytes: int, timeout: float) -> None:
        self.timeout = timeout
        self.slice_bytes = slice_bytes
        self._nslices = nslices
        self.ops: list[DeviceOps] = []
        self.tensors: dict[int, torch.Tensor] = {}
        group_of: list[int | None] = []
        by_device: dict[str, int] = {}
        for r in regions:
            if str(r.device).startswith("cpu"):
                group_of.append(None)
                continue
            self.tensors[r.index] = _region_tensor(r)
            dev = str(r.device)
            if dev not in by_device:
                try:
                    self.ops.append(ops if ops is not None else device_ops_for(dev))
                except Exception as exc:  # noqa: BLE001 - no driver, bad name: say which region
                    raise TransportError(f"tcp transport: region {r.index} is on {dev}, which has no "
                                         f"device operations here: {exc}") from exc
                by_device[dev] = len(self.ops) - 1
            group_of.append(by_device[dev])
        self.group_of: tuple[int | None, ...] = tuple(group_of)
        self._streams: dict[tuple[int, str], DeviceStream] = {}
        self._pools: dict[str, SlicePool] = {}
        self._lock = threading.Lock()
        self.stats = BounceStats()

    @property
    def any(self) -> bool:
        return bool(self.ops)

    def stream(self, group: int, direction: str) -> DeviceStream:
        with self._lock:
            s = self._streams.get((group, direction))
            if s is None:
                s = self._streams[(group, direction)] = self.ops[group].new_stream()
            return s

    def pool(self, side: str) -> SlicePool:
        """The holder's ("send") or the reader's ("recv") pool; pinned with the first device's
        allocator (CUDA pinned memory is usable by every device of the process)."""
        with self._lock:
            p = self._pools.get(side)
            if p is None:
                p = self._pools[side] = SlicePool(self.ops[0], self._nslices, self.slice_bytes,
                                                  "holder" if side == "send" else "reader")
            return p

    def pools(self) -> dict[str, SlicePool]:
        with self._lock:
            return dict(self._pools)
