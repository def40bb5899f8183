"""A real TCP transport: the holder serves READs of its registered memory over plain sockets.

Used where there is no RDMA. The reader sends one request per connection listing many runs
(region, offset, nbytes); the holder validates every run against what it registered and
streams the bytes back, and the reader receives them straight into its own registered memory
with vectored ``recvmsg_into`` (no staging copy). Large plans are split over several parallel
connections. Frames carry CRC-protected headers and a length trailer (see ``wire.py``; metadata in ``metadata.py``), plus
an optional payload CRC, so truncation and corruption are detected rather than loaded.

Reads are posted to a small worker pool and return a handle whose ``wait`` is bounded; a
holder that dies mid-read closes its sockets, which the reader sees at once as ``PeerDied``.

Device (CUDA) regions, registered with their tensor, go through a small pinned bounce buffer on
either side (``bounce.py``, ``bounce_send.py``, ``bounce_recv.py``): copies and socket I/O overlap
slice by slice, and a read is over only once its last host-to-device copy completed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
import zlib
from typing import Sequence

import numpy as np

from pdxfer.device import DeviceOps
from pdxfer.transport.plan import TransferPlan
from pdxfer.transport.base import (
    PeerDied,
    PeerUnreachable,
    ReadState,
    RegionUnknown,
    RegisteredRegion,
    Transport,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from pdxfer.transport.tcp import handshake, wire
from pdxfer.transport.tcp.bounce import DevicePlane, segment
from pdxfer.transport.tcp.bounce_recv import H2DTracker, receive_segments
from pdxfer.transport.tcp.connection import Conn, PeerConns, is_stale
from pdxfer.transport.tcp.handle import TcpReadHandle
from pdxfer.transport.tcp.metadata import encode_metadata, parse_metadata
from pdxfer.transport.runs import SMALL_PLAN, check_plan
from pdxfer.transport.tcp.plan import split_runs
from pdxfer.transport.tcp.server import RegionTable, TcpServer
from pdxfer.common.ports import bind_in_range, parse_port_spec


class TcpTransport(Transport):
    """See the module docstring. ``connections`` parallel sockets per peer; plans smaller than
    ``split_min_bytes`` use one of them (latency), bigger ones are split by bytes across all.

    Device regions: ``bounce_slices`` x ``bounce_slice_bytes`` of pinned memory per side (holder,
    reader; allocated on first use), ``device_timeout`` bounds every wait for a copy or a free
    slice, and ``device_ops`` replaces :func:`pdxfer.device.device_ops_for` for every device
    region (tests inject an asynchronous CPU stand-in).
    """

    kind = "tcp"

    def __init__(
        self,
        listen_host: str = "127.0.0.1",
        listen_port: int | str = 0,
        advertise_host: str | None = None,
        connections: int = 2,
        split_min_bytes: int = 2 << 20,
        io_timeout: float = 30.0,
        payload_crc: bool = False,
        socket_buffer: int = 4 << 20,
        max_connections: int = 256,
        hello_timeout: float = 1.0,
        frame_timeout: float = 30.0,
        idle_timeout: float = 600.0,
        max_handshakes_per_peer: int = 32,
        bounce_slices: int = 4,
        bounce_slice_bytes: int = 4 << 20,
        device_timeout: float = 30.0,
        device_ops: DeviceOps | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if io_timeout <= 0:
            raise ValueError(f"io_timeout must be > 0, got {io_timeout}")
        if bounce_slices < 1 or bounce_slice_bytes < 1:
            raise ValueError(f"bounce_slices and bounce_slice_bytes must be >= 1, got {bounce_slices} "
                             f"and {bounce_slice_bytes}")
        if device_timeout <= 0:
            raise ValueError(f"device_timeout must be > 0, got {device_timeout}")
        self._bounce = (int(bounce_slices), int(bounce_slice_bytes), float(device_timeout))
        self._device_ops = device_ops
        self._local_dev = np.zeros(0, dtype=bool)
        self._has_dev = False
        self._listen = (listen_host, parse_port_spec(listen_port))
        self._advertise = advertise_host
        self._nconns = int(connections)
        self._split_min = int(split_min_bytes)
        self._io_timeout = float(io_timeout)
        self._flags = wire.FLAG_PAYLOAD_CRC if payload_crc else 0
        self._bufsize = int(socket_buffer)
        # Holder-side bounds on what one reader connection may cost (see TcpServer).
        self._server_limits = {"max_connections": max_connections, "hello_timeout": hello_timeout,
                               "frame_timeout": frame_timeout, "idle_timeout": idle_timeout,
                               "max_handshakes_per_peer": max_handshakes_per_peer}
        self._instance = os.urandom(16)
        self._secret = handshake.new_secret()  # replaced by every register()
        self._table = RegionTable()
        self._local_views: tuple[memoryview | None, ...] = ()
        self._server: TcpServer | None = None
        self._peers: dict[str, PeerConns] = {}
        self._lock = threading.Lock()
        self._inflight: set[TcpReadHandle] = set()
        self._req_ids = itertools.count(1)
        self._closed = False

    # ------------------------------------------------------------------ memory
    def register(self, regions: Sequence[RegisteredRegion]) -> None:
        self._check_open()
        if self._table.regions:
            raise TransportError("tcp transport: regions are already registered; deregister first")
        for i, r in enumerate(regions):
            if r.index != i:
                raise RegionUnknown(f"region at position {i} carries index {r.index}; indices must be 0..n-1")
            if r.nbytes < 0 or (r.nbytes and not r.ptr):
                raise TransportError(f"region {i}: bad pointer/size ({r.ptr:#x}, {r.nbytes})")
        nslices, slice_bytes, dev_timeout = self._bounce
        plane = DevicePlane(regions, self._device_ops, nslices, slice_bytes, dev_timeout)
        # A new registration is a new secret: metadata handed out before it no longer opens the
        # holder, and readers still connected under the old one are cut (they must look it up again).
        self._secret = handshake.new_secret()
        with self._lock:
            server = self._server
        if server is not None:
            server.drop_connections()
        self._table.set(regions, plane)
        self._local_views = self._table.views()
        self._local_dev = np.array([g is not None for g in plane.group_of], dtype=bool)
        self._has_dev = bool(self._local_dev.any())

    def bounce_stats(self) -> dict[str, int]:
        """Counters of the device bounce path (slices moved, how many overlapped a copy, peak
        slices in use per side); all zero without device regions."""
        plane = self._table.plane
        out = dict.fromkeys(("d2h_slices", "d2h_staged_ahead", "d2h_overlapped", "h2d_slices",
                             "h2d_overlapped", "send_peak_slices", "recv_peak_slices", "leaked_slices"), 0)
        if plane is not None:
            out.update(plane.stats.snapshot())
            for side, pool in plane.pools().items():
                out[f"{side}_peak_slices"] = pool.peak_in_use
                out["leaked_slices"] += pool.leaked
        return out

    def deregister(self) -> None:
        """Forget the regions. In-flight reads are cancelled first (each stops before ``cancel``
        returns), so no byte lands in memory the caller may free next; the holder side waits
        for serves still sending from the old memory."""
        with self._lock:
            handles = list(self._inflight)
        for h in handles:
            h.cancel(timeout=2.0)
        self._local_views = ()
        self._has_dev = False
        self._local_dev = np.zeros(0, dtype=bool)
        if not self._table.clear(timeout=5.0) and self._server is not None:
            # A serve is stuck on a slow reader: cut it rather than keep reading freed memory.
            self._server.drop_connections()
            self._table.clear(timeout=5.0)

    # ------------------------------------------------------------------ holder side
    def guard_counts(self) -> dict[str, int]:
        with self._lock:
            server = self._server
        return server.guard_counts() if server is not None else {}

    def _ensure_server(self) -> TcpServer:
        with self._lock:
            if self._server is None:
                host, ports = self._listen
                try:
                    self._server = bind_in_range(ports, host, lambda port: TcpServer(
                        self._table, self._instance, lambda: self._secret, host, port, self._bufsize,
                        **self._server_limits))
                except OSError as exc:
                    raise TransportError(f"tcp transport cannot listen on {host}:{ports}: {exc}") from exc
            return self._server

    @property
    def port(self) -> int:
        return self._ensure_server().port

    def metadata(self) -> bytes:
        self._check_open()
        server = self._ensure_server()
        host = self._advertise or self._listen[0]
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return encode_metadata(host, server.port, self._instance, wire.WIRE_VERSION, self._table.regions,
                               self._secret)

    # ------------------------------------------------------------------ reader side
    def connect(self, peer_metadata: bytes, timeout: float = 5.0) -> str:
        self._check_open()
        info = parse_metadata(peer_metadata)
        pid = info.peer_id
        with self._lock:
            known = self._peers.get(pid)
            if known is not None and known.info == info:
                return pid
        if known is not None:
            # Same holder, new registration (new secret, maybe new regions): the old connections
            # are refused from now on, so start over with the new metadata.
            self.disconnect(pid)
        peer = PeerConns(info, self._nconns, timeout, self._io_timeout, self._bufsize)
        deadline = time.monotonic() + timeout
        try:
            for c in peer.conns:
                with c.lock:
                    c.connect_timeout = max(0.05, deadline - time.monotonic())
                    c.ensure()
                    c.connect_timeout = timeout
        except (TransportError, OSError) as exc:
            for c in peer.conns:
                c.drop()
            if isinstance(exc, (handshake.AuthRefused, handshake.VersionMismatch)):
                raise
            if isinstance(exc, TransportError):
                raise PeerUnreachable(str(exc)) from exc
            raise PeerUnreachable(f"cannot reach {pid}: {exc}") from exc
        with self._lock:
            if pid in self._peers:  # lost a race with another connect: keep the first
                for c in peer.conns:
                    c.drop()
            else:
                self._peers[pid] = peer
        return pid

    def disconnect(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
        if p is not None:
            for c in p.conns:
                c.abort()
                c.drop()
                c.queue.shutdown(wait=False)  # its thread ends once queued parts settled

    def read(self, peer: str, plan: TransferPlan) -> TcpReadHandle:
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            raise PeerUnreachable(f"peer {peer!r} is not connected (connect() it first)")
        runs = check_plan(plan, p.info.region_sizes, self._table.sizes(), p.info.peer_id)
        parts = split_runs(runs, len(p.conns), self._split_min)
        handle = TcpReadHandle(peer, len(parts))
        if not parts:
            return handle
        with self._lock:
            self._inflight.add(handle)
        start = next(p.rr)
        for i, part in enumerate(parts):
            conn = p.conns[(start + i) % len(p.conns)]
            with conn.lock:  # submission order on a connection is request order on its socket
                # Send from the caller's thread when nothing is queued on the connection, so the
                # holder starts while the queue thread wakes up to receive (one hand-off less).
                # A part into device memory first takes a bounce slice, which may wait: its queue
                # thread sends it.
                direct = conn.queued == 0 and not self._to_device(part)
                req_id = self._send_now(handle, conn, part) if direct else None
                try:
                    conn.queue.submit(self._run_part, handle, conn, part, peer, req_id)
                    conn.queued += 1
                except RuntimeError as exc:  # queue shut down by a concurrent close()
                    if req_id is not None:
                        conn.drop()
                    handle._end(conn if req_id is not None else None,
                                TransferCancelled(f"transport closed: {exc}"))
        return handle

    def _to_device(self, runs: np.ndarray) -> bool:
        return self._has_dev and bool(self._local_dev[runs[:, 2]].any())

    def _send_now(self, handle: TcpReadHandle, conn: Conn, runs: np.ndarray) -> int | None:
        """Request id if the request went out now, None if the queue thread must (re)connect and
        send. Caller holds ``conn.lock`` and nothing is queued on ``conn``."""
        if conn.sock is None or is_stale(conn.sock) or not handle._begin(conn):
            return None  # no live socket, or the read is already over: leave it to the queue
        try:
            return self._send_request(conn.sock, runs)
        except OSError:
            conn.drop()
            with handle._lock:
                handle._active.discard(conn)
            return None

    def _run_part(self, handle: TcpReadHandle, conn: Conn, runs: np.ndarray, peer: str,
                  sent: int | None = None) -> None:
        """The connection's queue thread: receive one part (sending it first unless ``read``
        already did, in which case ``sent`` is the request id)."""
        err: TransportError | None = None
        used: Conn | None = conn if sent is not None else None
        try:
            if sent is None:
                if not handle._begin(conn):
                    return
                used = conn
            try:
                tracker = self._tracker(handle, runs, peer) if self._to_device(runs) else None
                # Leaving the tracker waits for every host-to-device copy it enqueued, on success
                # and on failure alike: the part ends only once nothing more can land.
                with tracker if tracker is not None else contextlib.nullcontext():
                    if sent is None:
                        sock = conn.ensure()
                        # A cancel that came while we (re)connected found no socket to cut: check now
                        # that conn.sock is set, so a later cancel cuts it and nothing lands after it.
                        if not handle._wanted():
                            return
                        sent = self._send_request(sock, runs)
                    self._receive(conn, runs, sent, tracker)
            except BaseException:
                conn.drop()  # stream position unknown: never reuse this socket
                raise
        except TransportError as exc:
            err = exc
        except (socket.timeout, BlockingIOError):
            err = TransferTimeout(f"no progress from {peer} for {self._io_timeout}s")
        except OSError as exc:
            err = PeerDied(f"connection to {peer} failed mid-read: {exc}")
        except Exception as exc:  # noqa: BLE001 - a worker must always settle its handle
            err = TransportError(f"read from {peer} failed: {exc!r}")
        finally:
            with conn.lock:
                conn.queued -= 1
            # If the caller cancelled or a sibling failed first, that first error stands.
            handle._end(used, err)
            if handle.poll() is not ReadState.PENDING:
                with self._lock:
                    self._inflight.discard(handle)

    def _tracker(self, handle: TcpReadHandle, runs: np.ndarray, peer: str) -> H2DTracker:
        """A tracker holding one reader bounce slice, taken before the request goes out (in short
        waits, so a cancel is seen within 0.1 s)."""
        plane = self._table.plane
        if plane is None:
            raise TransferCancelled(f"read from {peer}: regions were deregistered")
        pool = plane.pool("recv")
        deadline = time.monotonic() + plane.timeout
        while handle._wanted():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"read from {peer}: no reader bounce slice came free in "
                                      f"{plane.timeout:.1f}s")
            first = pool.acquire(min(0.1, left))
            if first is not None:
                return H2DTracker(plane, first)
        raise TransferCancelled(f"read from {peer} cancelled")

    def _send_request(self, sock: socket.socket, runs: np.ndarray) -> int:
        req_id = next(self._req_ids)
        if len(runs) <= SMALL_PLAN:
            sock.sendall(wire.pack_request(req_id, [(r[0], r[1], r[4]) for r in runs.tolist()], self._flags))
        else:
            sock.sendall(wire.pack_request_array(req_id, runs[:, 0], runs[:, 1], runs[:, 4], self._flags))
        return req_id

    def _receive(self, conn: Conn, runs: np.ndarray, req_id: int, tracker: H2DTracker | None = None) -> None:
        sock = conn.sock
        if sock is None:
            raise PeerDied(f"connection to {conn.info.peer_id} was aborted")
        if tracker is not None:
            self._receive_bounced(conn, sock, runs, req_id, tracker)
            return
        lviews = self._local_views
        # Build the destination views while the holder works on the request.
        starts = runs[:, 3].tolist()
        ends = (runs[:, 3] + runs[:, 4]).tolist()
        if len(lviews) == 1:
            lv = lviews[0]
            views = [lv[a:b] for a, b in zip(starts, ends)]
        else:
            views = [lviews[r][a:b] for r, a, b in zip(runs[:, 2].tolist(), starts, ends)]
        total, flags = self._response_head(conn, sock, runs, req_id)
        wire.recv_into_views(sock, list(views), total, "read payload")
        crc = self._trailer(sock, total)
        if flags & wire.FLAG_PAYLOAD_CRC:
            mine = 0
            for v in views:
                mine = zlib.crc32(v, mine)
            if mine != crc:
                raise wire.CorruptFrame(f"payload CRC mismatch from {conn.info.peer_id}")

    def _receive_bounced(self, conn: Conn, sock: socket.socket, runs: np.ndarray, req_id: int,
                         tracker: H2DTracker) -> None:
        """Like the in-place path, with device destinations received into bounce slices."""
        plane = tracker.plane
        segs = segment(runs[:, 2].tolist(), runs[:, 3].tolist(), runs[:, 4].tolist(), plane.group_of,
                       plane.slice_bytes)
        total, flags = self._response_head(conn, sock, runs, req_id)
        want_crc = bool(flags & wire.FLAG_PAYLOAD_CRC)
        mine = receive_segments(sock, segs, self._local_views, tracker, want_crc)
        crc = self._trailer(sock, total)
        if want_crc and mine != crc:
            raise wire.CorruptFrame(f"payload CRC mismatch from {conn.info.peer_id}")

    @staticmethod
    def _response_head(conn: Conn, sock: socket.socket, runs: np.ndarray, req_id: int) -> tuple[int, int]:
        """(payload length, flags) of an OK response to ``req_id``; the holder's error as its type."""
        status, rid, length, flags = wire.unpack_response(wire.recv_exact(sock, wire.RESP_SIZE, "response header"))
        if rid != req_id:
            raise wire.CorruptFrame(f"response for request {rid}, expected {req_id}")
        if status != wire.OK:
            if length > wire.MAX_ERROR_TEXT:
                raise wire.CorruptFrame(f"error text of {length} bytes")
            text = wire.recv_exact(sock, length, "error text").decode(errors="replace")
            raise wire.error_for_status(status, text, conn.info.peer_id)
        total = int(runs[:, 4].sum())
        if length != total:
            raise wire.CorruptFrame(f"response announces {length} bytes, request asked for {total}")
        return total, flags

    @staticmethod
    def _trailer(sock: socket.socket, total: int) -> int:
        """The payload CRC from a trailer that must close a ``total``-byte payload."""
        magic, crc, echoed = wire.TRAILER.unpack(wire.recv_exact(sock, wire.TRAILER.size, "trailer"))
        if magic != wire.MAGIC_END or echoed != total:
            raise wire.CorruptFrame(f"bad trailer (magic {magic:#x}, length {echoed} of {total})")
        return crc

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("tcp transport is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._inflight)
            peers = list(self._peers.values())
            self._peers.clear()
            server, self._server = self._server, None
        for h in handles:
            h.cancel(timeout=1.0)
        for p in peers:
            for c in p.conns:
                c.abort()
                c.drop()
        if server is not None:
            server.close()
        for p in peers:
            for c in p.conns:
                c.queue.shutdown(wait=False)  # queued parts still run, see the cancel, and settle
        self._table.clear(timeout=1.0)
        self._local_views = ()


__all__ = ["TcpTransport"]
