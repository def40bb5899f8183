"""The holder's half of device memory over TCP: copy device -> pinned slice, send the slice.

Slices are staged ahead on the plane's device-to-host stream while the socket sends the slice
before them, and a slice goes out only once its copy event completed. Host runs of the same
request are sent in place from registered memory, in payload order.
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
from pdxfer.transport.tcp.bounce import DevicePlane, Segment, Slice, SlicePool


class BounceBusy(TransportError):
    """No bounce slice came free in time; nothing was sent yet, so the holder answers with an
    error frame and the connection stays usable."""


def _stage(plane: DevicePlane, seg: Segment, sl: Slice) -> DeviceEvent:
    assert seg.group is not None
    ops = plane.ops[seg.group]
    stream = plane.stream(seg.group, "d2h")
    off = 0
    for r, o, n in seg.runs:
        ops.copy(sl.tensor, off, plane.tensors[r], o, n, stream)
        off += n
    return ops.record_event(stream)


def send_bounced(sock: socket.socket, req_id: int, flags: int, segments: Sequence[Segment],
                 views: Sequence[memoryview | None], plane: DevicePlane) -> None:
    """Send the OK response, payload and trailer of one request whose runs (already validated)
    touch device regions. Raises BounceBusy before the header if no slice came free within the
    plane's timeout; any failure after the header leaves the stream unusable (the caller closes
    the connection, the reader sees PeerDied)."""
    pool = plane.pool("send")
    first = pool.acquire(plane.timeout)
    if first is None:
        raise BounceBusy(f"holder bounce buffer busy: no slice of {pool.nslices} came free in "
                         f"{plane.timeout:.1f}s")
    length = sum(s.nbytes for s in segments)
    spare: list[Slice] = [first]
    staged: collections.deque[tuple[int, Slice, DeviceEvent]] = collections.deque()
    ahead = 0
    crc = 0
    want_crc = bool(flags & wire.FLAG_PAYLOAD_CRC)
    try:
        sock.sendall(wire.pack_response(wire.OK, req_id, length, flags))
        for i, seg in enumerate(segments):
            # Stage later slices before sending this segment, so copies run while the socket works.
            while ahead < len(segments):
                if segments[ahead].group is None:
                    ahead += 1
                    continue
                sl = spare.pop() if spare else pool.try_acquire()
                if sl is None:
                    break
                try:
                    ev = _stage(plane, segments[ahead], sl)
                except BaseException:
                    # Copies enqueued before the failing one may still run: release after them.
                    g = segments[ahead].group
                    assert g is not None
                    staged.append((ahead, sl, plane.ops[g].record_event(plane.stream(g, "d2h"))))
                    raise
                staged.append((ahead, sl, ev))
                ahead += 1
            if seg.group is None:
                bufs = [views[r][o:o + n] for r, o, n in seg.runs]  # type: ignore[index]
                if want_crc:
                    for b in bufs:
                        crc = zlib.crc32(b, crc)
                wire.send_views(sock, bufs)
                continue
            idx, sl, ev = staged.popleft()
            assert idx == i, "a device segment was not staged in order"
            if not ev.wait(plane.timeout):
                staged.appendleft((idx, sl, ev))  # still copying: released only once it stops
                raise TransferTimeout(f"device-to-host copy of a {seg.nbytes}-byte slice not done "
                                      f"after {plane.timeout:.1f}s")
            if ev.error:
                spare.append(sl)
                raise TransportError(f"device-to-host copy failed: {ev.error}")
            # Counted before the send: is the next slice already copying while this one goes out?
            plane.stats.add(d2h_slices=1, d2h_staged_ahead=int(bool(staged)),
                            d2h_overlapped=int(bool(staged) and not staged[0][2].query()))
            buf = sl.view[:seg.nbytes]
            if want_crc:
                crc = zlib.crc32(buf, crc)
            try:
                sock.sendall(buf)
            finally:
                # Keep one slice for the next stage; the rest go back for other requests now.
                if staged or spare:
                    pool.release(sl)
                else:
                    spare.append(sl)
        sock.sendall(wire.pack_trailer(crc, length))
    finally:
        for sl in spare:
            pool.release(sl)
        _release_staged(pool, staged, plane.timeout)


def _release_staged(pool: SlicePool, staged: Sequence[tuple[int, Slice, DeviceEvent]], timeout: float) -> None:
    """After a failure, slices still being copied into go back only once their copies stopped."""
    deadline = time.monotonic() + timeout
    for _, sl, ev in staged:
        pool.release_after(sl, [ev], deadline)


__all__ = ["BounceBusy", "send_bounced"]
