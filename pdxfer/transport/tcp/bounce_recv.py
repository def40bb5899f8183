"""The reader's half of device memory over TCP: receive into a pinned slice, copy it to the device.

Each slice's host-to-device copies are enqueued on the plane's own stream as soon as its bytes
arrived, and the socket goes on into the next slice meanwhile. :class:`H2DTracker` owns the
slices and events of one request: leaving it (normally or on any error) waits, bounded, for every
copy it enqueued, so a read is reported done -- or failed -- only once no copy of it can still
write into the destination.
"""

from __future__ import annotations

import collections
import socket
import time
import zlib
from typing import Sequence

from pdxfer.device import DeviceEvent
from pdxfer.transport.base import TransportError, TransferTimeout
from pdxfer.transport.tcp import wire
from pdxfer.transport.tcp.bounce import DevicePlane, Segment, Slice


class H2DTracker:
    """Slices and copy events of one reader request (see the module docstring). ``first`` is the
    slice acquired before the request was sent: holding one from the start means this request
    never waits for another request's slice once the holder is sending."""

    def __init__(self, plane: DevicePlane, first: Slice) -> None:
        self.plane = plane
        self.pool = plane.pool("recv")
        self._free: list[Slice] = [first]
        self._busy: collections.deque[tuple[Slice, DeviceEvent]] = collections.deque()

    def _next_slice(self) -> Slice:
        if self._free:
            return self._free.pop()
        sl = self.pool.try_acquire()
        if sl is not None:
            return sl
        sl, ev = self._busy.popleft()  # reuse our own oldest slice once its copies are done
        if not ev.wait(self.plane.timeout):
            self._busy.appendleft((sl, ev))
            raise TransferTimeout(f"host-to-device copy not done after {self.plane.timeout:.1f}s")
        if ev.error:
            self._free.append(sl)
            raise TransportError(f"host-to-device copy failed: {ev.error}")
        return sl

    def receive(self, sock: socket.socket, seg: Segment, crc: int | None) -> int | None:
        """Receive one device segment and enqueue its copies; returns the running payload CRC."""
        assert seg.group is not None
        sl = self._next_slice()
        # Does this slice arrive while an earlier one is still being copied to the device?
        overlapped = any(not ev.query() for _, ev in self._busy)
        try:
            wire.recv_into_views(sock, [sl.view[:seg.nbytes]], seg.nbytes, "read payload")
        except BaseException:
            self._free.append(sl)
            raise
        if crc is not None:
            crc = zlib.crc32(sl.view[:seg.nbytes], crc)
        plane = self.plane
        ops = plane.ops[seg.group]
        stream = plane.stream(seg.group, "h2d")
        off = 0
        try:
            for r, o, n in seg.runs:
                ops.copy(plane.tensors[r], o, sl.tensor, off, n, stream)
                off += n
        finally:
            # Even a copy call that raised half-way may have enqueued the ones before it.
            self._busy.append((sl, ops.record_event(stream)))
        self.plane.stats.add(h2d_slices=1, h2d_overlapped=int(overlapped))
        # Hand finished slices back at once (keeping one) so concurrent requests can use them.
        while len(self._busy) > 1 and self._busy[0][1].query() and not self._busy[0][1].error:
            self.pool.release(self._busy.popleft()[0])
        return crc

    def finish(self) -> None:
        """Wait (bounded) for every copy, return the slices; raise if a copy failed or did not
        finish in time -- then the slice stays out of the pool and the error says the destination
        may still change."""
        deadline = time.monotonic() + self.plane.timeout
        errors = [ev.error for _, ev in self._busy if ev.wait(max(0.0, deadline - time.monotonic())) and ev.error]
        stuck = 0
        for sl, ev in self._busy:
            if not self.pool.release_after(sl, [ev], deadline):
                stuck += 1
        self._busy.clear()
        for sl in self._free:
            self.pool.release(sl)
        self._free.clear()
        if stuck:
            raise TransferTimeout(f"{stuck} host-to-device copies still pending after {self.plane.timeout:.1f}s: "
                                  f"the destination may still change")
        if errors:
            raise TransportError(f"host-to-device copy failed: {errors[0]}")

    def __enter__(self) -> "H2DTracker":
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.finish()
            return
        try:
            self.finish()
        except TransportError as late:
            raise late from exc  # the copies outlived the failure: that is what the caller must know


def receive_segments(sock: socket.socket, segments: Sequence[Segment], views: Sequence[memoryview | None],
                     tracker: H2DTracker, want_crc: bool) -> int:
    """Receive one request's payload, host segments in place, device ones through the tracker;
    returns the payload CRC (0 unless ``want_crc``)."""
    crc: int | None = 0 if want_crc else None
    for seg in segments:
        if seg.group is None:
            bufs = [views[r][o:o + n] for r, o, n in seg.runs]  # type: ignore[index]
            wire.recv_into_views(sock, list(bufs), seg.nbytes, "read payload")
            if crc is not None:
                for b in bufs:
                    crc = zlib.crc32(b, crc)
        else:
            crc = tracker.receive(sock, seg, crc)
    return crc or 0


__all__ = ["H2DTracker", "receive_segments"]
