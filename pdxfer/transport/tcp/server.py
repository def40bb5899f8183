"""The holder side of the TCP transport: serve READs of registered memory, nothing else.

One thread blocks in ``accept`` and one thread per connection blocks in ``recv``: an idle holder
uses no CPU. Every requested run is checked against the registered region table before a byte
is sent, so a reader can never see memory outside what the holder registered; a bad run gets
an error frame naming it and the connection stays usable. Host memory is sent in place; a
request touching device regions goes through the pinned bounce buffer (``bounce_send``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import socket
import struct
import threading
import time
import zlib
from typing import Callable, Iterator, Sequence

import numpy as np

from pdxfer.transport.tcp import handshake, wire
from pdxfer.transport.base import RegisteredRegion, TransferTimeout, TransportError
from pdxfer.transport.tcp.bounce import DevicePlane, segment
from pdxfer.transport.tcp.bounce_send import BounceBusy, send_bounced
from pdxfer.transport.runs import SMALL_PLAN, fault, first_fault

log = logging.getLogger(__name__)


def region_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``ptr`` (memory the caller keeps alive)."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class RegionTable:
    """Registered regions plus a count of in-flight serves, so deregistration can wait for them.
    Device regions have no view (their pointer is not host memory: ``plane`` copies them)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._regions: tuple[RegisteredRegion, ...] = ()
        self._views: tuple[memoryview | None, ...] = ()
        self._sizes: tuple[int, ...] = ()
        self._plane: DevicePlane | None = None
        self._active = 0

    def set(self, regions: Sequence[RegisteredRegion], plane: DevicePlane | None = None) -> None:
        with self._cond:
            self._regions = tuple(regions)
            self._sizes = tuple(r.nbytes for r in regions)
            on_device = plane.group_of if plane is not None else (None,) * len(regions)
            self._views = tuple(region_view(r.ptr, r.nbytes) if g is None else None
                                for r, g in zip(regions, on_device))
            self._plane = plane if plane is not None and plane.any else None

    @property
    def regions(self) -> tuple[RegisteredRegion, ...]:
        return self._regions

    def views(self) -> tuple[memoryview | None, ...]:
        return self._views

    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def plane(self) -> DevicePlane | None:
        return self._plane

    @contextlib.contextmanager
    def serving(self) -> Iterator[tuple[tuple[memoryview | None, ...], tuple[int, ...], DevicePlane | None]]:
        with self._cond:
            self._active += 1
            snap = (self._views, self._sizes, self._plane)
        try:
            yield snap
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def clear(self, timeout: float) -> bool:
        """Drop every region; True once no serve still touches the old memory (bounded wait)."""
        with self._cond:
            self._regions = ()
            self._views = ()
            self._sizes = ()
            self._plane = None
            return self._cond.wait_for(lambda: self._active == 0, timeout)


def _rejection(i: int, region: int, offset: int, nbytes: int, sizes: Sequence[int]) -> tuple[int, str]:
    """(status, text) for run ``i`` of a request that :func:`runs.fault` rejected."""
    if not region < len(sizes):
        have = f"0..{len(sizes) - 1}" if sizes else "none"
        return wire.ERR_REGION_UNKNOWN, f"run {i}: region {region} is not registered (registered: {have})"
    return wire.ERR_OUT_OF_RANGE, (f"run {i}: bytes [{offset}, {offset + nbytes}) of region {region} "
                                   f"lie outside its {sizes[region]} registered bytes")


def validate_runs(runs: np.ndarray, sizes: Sequence[int]) -> tuple[int, str] | None:
    """None if every run (a RUN_DTYPE array) lies inside a registered region, else
    (status, text naming the first bad run)."""
    i = first_fault(runs["region"].astype(np.uint64), runs["offset"], runs["nbytes"], sizes)
    if i is None:
        return None
    return _rejection(i, int(runs["region"][i]), int(runs["offset"][i]), int(runs["nbytes"][i]), sizes)


# accept() errors that say "not now" (out of descriptors or memory, a peer gone before we took it):
# the listener stays up and tries again; anything else while open is logged and retried too.
_TRANSIENT_ACCEPT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                     errno.EPROTO, errno.EPERM, errno.EINTR}


def _rcv_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel receive timeout (0: none), which keeps the socket blocking (see wire.set_io_timeout)."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def _keepalive(sock: socket.socket) -> None:
    """Find readers whose host vanished (no FIN ever comes) within about a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class _RateLimitedLog:
    """One warning per ``every`` seconds for a condition that can repeat thousands of times."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last = -1e9
        self.suppressed = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.every:
            extra = f" ({self.suppressed} more since the last warning)" if self.suppressed else ""
            log.warning(msg + extra, *args)
            self._last, self.suppressed = now, 0
        else:
            self.suppressed += 1


class _Pending:
    """Connections accepted but not yet authenticated, oldest first, counted per peer address:
    the ones given up first when the holder is full or one address opens too many."""

    def __init__(self) -> None:
        self._order: dict[socket.socket, str] = {}  # insertion order is accept order
        self._per_host: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, conn: socket.socket) -> bool:
        return conn in self._order

    def add(self, conn: socket.socket, host: str) -> None:
        self._order[conn] = host
        self._per_host[host] = self._per_host.get(host, 0) + 1

    def remove(self, conn: socket.socket) -> bool:
        host = self._order.pop(conn, None)
        if host is None:
            return False
        left = self._per_host[host] - 1
        if left:
            self._per_host[host] = left
        else:
            del self._per_host[host]
        return True

    def count(self, host: str) -> int:
        return self._per_host.get(host, 0)

    def oldest(self, host: str | None = None) -> socket.socket | None:
        for conn, h in self._order.items():
            if host is None or h == host:
                return conn
        return None


class TcpServer:
    """Accepts reader connections and serves their READ requests from a :class:`RegionTable`.

    Nothing is read from a connection but the handshake (``handshake.admit``) until it proved
    ``secret()``. What a peer can cost the holder is bounded: ``max_connections`` connections at
    once, ``hello_timeout`` from accept to a finished handshake, ``frame_timeout`` to finish a
    frame it started, ``idle_timeout`` between requests (readers reconnect transparently), and
    at most ``wire.MAX_RUNS_PER_REQUEST`` runs buffered per request. Connections still in their
    handshake never crowd out a reader: at the cap the oldest of them is cut for a new one (only
    authenticated readers filling every slot refuse a newcomer), and one peer address has at most
    ``max_handshakes_per_peer`` of them (its oldest is cut for its newest). Running out of
    descriptors never stops the listener.
    """

    def __init__(self, table: RegionTable, instance: bytes, secret: Callable[[], bytes], host: str, port: int,
                 bufsize: int, max_connections: int = 256, hello_timeout: float = 1.0,
                 frame_timeout: float = 30.0, idle_timeout: float = 600.0,
                 max_handshakes_per_peer: int = 32) -> None:
        for name, v in (("max_connections", max_connections), ("hello_timeout", hello_timeout),
                        ("frame_timeout", frame_timeout), ("idle_timeout", idle_timeout),
                        ("max_handshakes_per_peer", max_handshakes_per_peer)):
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self._table = table
        self._instance = instance
        self._secret = secret
        self._bufsize = bufsize
        self._max_conns = int(max_connections)
        self._max_pending_per_peer = int(max_handshakes_per_peer)
        self._hello_timeout = float(hello_timeout)
        self._frame_timeout = float(frame_timeout)
        self._idle_timeout = float(idle_timeout)
        self._accept_log = _RateLimitedLog()
        self._cap_log = _RateLimitedLog()
        self._evict_log = _RateLimitedLog()
        self.refused_connections = 0
        self.evicted_handshakes = 0
        self.auth_failures = 0  # readers that failed the proof (a wrong or stale secret)
        self.handshake_timeouts = 0  # connections that never finished their handshake in time
        self.send_timeout = 60.0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # every connection with a live thread
        self._pending = _Pending()  # the subset still in its handshake, not yet cut
        self._authed: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"pdxfer-tcp-accept-{self.port}",
                                               daemon=True)
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()  # blocks: no CPU while idle
            except OSError as exc:
                with self._lock:
                    if self._closed:
                        return  # listening socket shut down by close()
                self._accept_log.warn("pdxfer tcp holder on port %d: accept failed (%s); still listening",
                                      self.port, exc)
                # EMFILE leaves the pending connection queued, so accept() would fail again at
                # once: wait for descriptors to come back instead of spinning a core.
                time.sleep(0.1 if exc.errno in _TRANSIENT_ACCEPT else 0.5)
                continue
            accepted = time.monotonic()
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if not self._make_room(addr[0]):
                    self.refused_connections += 1
                    self._cap_log.warn("pdxfer tcp holder on port %d: refusing a connection from %s: "
                                       "%d authenticated readers fill max_connections", self.port, addr[0],
                                       len(self._authed))
                    conn.close()
                    continue
                wire.tune_socket(conn, self._bufsize)
                _keepalive(conn)
                # Idle readers may keep a connection for hours: only sends get a bound, so a
                # reader that stops reading cannot pin a serving thread (and deregister) forever.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(self.send_timeout), 0))
                self._conns.add(conn)
                self._pending.add(conn, addr[0])
                t = threading.Thread(target=self._serve_conn, args=(conn, addr, accepted), daemon=True,
                                     name=f"pdxfer-tcp-serve-{addr[0]}:{addr[1]}")
                self._threads.add(t)
            t.start()

    def _make_room(self, host: str) -> bool:
        """Under ``_lock``: cut handshakes so a connection from ``host`` fits; False if only
        authenticated readers are in the way."""
        if self._pending.count(host) >= self._max_pending_per_peer:
            self._evict(self._pending.oldest(host), f"{host} has {self._max_pending_per_peer} "
                                                    f"handshakes open (max_handshakes_per_peer)")
        if len(self._pending) + len(self._authed) < self._max_conns:
            return True
        victim = self._pending.oldest()
        if victim is None:
            return False
        self._evict(victim, f"{self._max_conns} connections open (max_connections)")
        return True

    def _evict(self, conn: socket.socket | None, why: str) -> None:
        if conn is None or not self._pending.remove(conn):
            return
        self.evicted_handshakes += 1
        self._evict_log.warn("pdxfer tcp holder on port %d: cut the oldest unauthenticated connection: %s",
                             self.port, why)
        # Its thread wakes from recv and ends; the slot counts as free from now on.
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def _serve_conn(self, conn: socket.socket, addr: tuple, accepted: float) -> None:
        try:
            # Counted as authenticated before its verdict is sent: a reader that holds an OK
            # verdict is never cut as a handshake in progress by a newcomer at the cap.
            try:
                handshake.admit(conn, self._instance, self._secret(), accepted + self._hello_timeout,
                                on_proven=lambda: self._promote(conn))
            except handshake.WrongProof:
                with self._lock:
                    self.auth_failures += 1
                raise
            except TransferTimeout:
                with self._lock:
                    self.handshake_timeouts += 1
                raise
            while self._serve_one(conn):
                pass
        except (OSError, TransportError) as exc:
            # A reader that died, sent garbage or failed its proof only costs its own connection.
            log.debug("connection from %s ended: %s", addr, exc)
        finally:
            with self._lock:
                self._pending.remove(conn)
                self._authed.discard(conn)
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def guard_counts(self) -> dict[str, int]:
        """Since start: connections refused at accept, handshakes cut for newcomers, failed
        proofs, handshakes past their deadline (what unauthenticated peers cost this holder)."""
        with self._lock:
            return {"refused_connections": self.refused_connections, "evicted_handshakes": self.evicted_handshakes,
                    "auth_failures": self.auth_failures, "handshake_timeouts": self.handshake_timeouts}

    def _promote(self, conn: socket.socket) -> bool:
        """A connection whose reader proved the secret leaves the handshakes for the readers;
        False if it was cut meanwhile (its slot went to someone else)."""
        with self._lock:
            if not self._pending.remove(conn):
                return False
            self._authed.add(conn)
            return True

    def _serve_one(self, conn: socket.socket) -> bool:
        head = bytearray(wire.REQ_SIZE)
        _rcv_timeout(conn, self._idle_timeout)
        k = conn.recv_into(head)
        if k == 0:
            return False  # reader closed between requests: a normal end
        _rcv_timeout(conn, self._frame_timeout)  # a frame once started must finish in time
        if k < wire.REQ_SIZE:
            head[k:] = wire.recv_exact(conn, wire.REQ_SIZE - k, "request header")
        flags, req_id, nruns, body_crc = wire.unpack_request_head(bytes(head))
        body = wire.recv_exact(conn, nruns * wire.RUN.size, "request runs") if nruns else b""
        if zlib.crc32(body) != body_crc:
            raise wire.CorruptFrame("request run list CRC mismatch")
        runs = np.frombuffer(body, dtype=wire.RUN_DTYPE)
        with self._table.serving() as (views, sizes, plane):
            if plane is not None:
                self._serve_bounced(conn, req_id, flags, runs, views, sizes, plane)
                return True
            if nruns <= SMALL_PLAN:  # plain Python is cheaper for a few runs
                self._serve_small(conn, req_id, flags, list(wire.RUN.iter_unpack(body)), views)
                return True
            bad = validate_runs(runs, sizes)
            if bad is not None:
                self._reject(conn, req_id, *bad)
                return True
            runs = runs[runs["nbytes"] > 0]
            starts = runs["offset"].tolist()
            ends = (runs["offset"] + runs["nbytes"]).tolist()
            if len(views) == 1:
                v0 = views[0]
                out = [v0[a:b] for a, b in zip(starts, ends)]
            else:
                out = [views[r][a:b] for r, a, b in zip(runs["region"].tolist(), starts, ends)]
            self._reply(conn, req_id, flags, out)
        return True

    def _serve_bounced(self, conn: socket.socket, req_id: int, flags: int, runs: np.ndarray,
                       views: tuple[memoryview | None, ...], sizes: tuple[int, ...], plane: DevicePlane) -> None:
        """A holder with device regions: the same checks, then host runs in place and device runs
        through the bounce buffer."""
        bad = validate_runs(runs, sizes)
        if bad is not None:
            self._reject(conn, req_id, *bad)
            return
        segs = segment(runs["region"].tolist(), runs["offset"].tolist(), runs["nbytes"].tolist(),
                       plane.group_of, plane.slice_bytes)
        if all(sg.group is None for sg in segs):  # host runs only: no slice needed, zero-copy as ever
            self._reply(conn, req_id, flags, [views[r][o:o + n] for sg in segs for r, o, n in sg.runs])
            return
        try:
            send_bounced(conn, req_id, flags, segs, views, plane)
        except BounceBusy as exc:
            self._reject(conn, req_id, wire.ERR_BAD_REQUEST, str(exc))
        except (OSError, TransportError):
            raise
        except Exception as exc:  # a device error mid-payload: the stream is unusable, cut it
            raise TransportError(f"serving request {req_id} failed: {exc!r}") from exc

    def _serve_small(self, conn: socket.socket, req_id: int, flags: int, runs: list[tuple[int, int, int]],
                     views: tuple[memoryview | None, ...]) -> None:
        """The same checks and reply as the vectorized path, in plain Python (cheaper for few runs)."""
        out: list[memoryview] = []
        sizes = [len(v) for v in views]  # type: ignore[arg-type]  # no device regions on this path
        for i, (r, o, n) in enumerate(runs):
            if fault(r, o, n, sizes) is not None:
                self._reject(conn, req_id, *_rejection(i, r, o, n, sizes))
                return
            if n:
                out.append(views[r][o:o + n])
        self._reply(conn, req_id, flags, out)

    @staticmethod
    def _reject(conn: socket.socket, req_id: int, status: int, text: str) -> None:
        blob = text.encode()[: wire.MAX_ERROR_TEXT]
        conn.sendall(wire.pack_response(status, req_id, len(blob)) + blob)

    @staticmethod
    def _reply(conn: socket.socket, req_id: int, flags: int, out: list[memoryview]) -> None:
        length = sum(len(v) for v in out)
        crc = 0
        if flags & wire.FLAG_PAYLOAD_CRC:
            for v in out:
                crc = zlib.crc32(v, crc)
        bufs: list[memoryview] = [memoryview(wire.pack_response(wire.OK, req_id, length, flags))]
        bufs += out
        bufs.append(memoryview(wire.pack_trailer(crc, length)))
        wire.send_views(conn, bufs)

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)
        # shutdown() wakes the threads blocked in accept/recv; close alone would not on Linux.
        for s in [self._sock, *conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._accept_thread.join(timeout)
        for t in threads:
            t.join(timeout)

    def drop_connections(self) -> None:
        """Cut every reader connection (used when memory is deregistered under a slow serve)."""
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
