"""Reader-side connections of the TCP transport: one socket each, reconnecting when stale."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdxfer.transport.base import PeerUnreachable, TransportError
from pdxfer.transport.tcp import handshake, wire
from pdxfer.transport.tcp.metadata import TcpPeerInfo


def is_stale(sock: socket.socket) -> bool:
    """True if an idle connection has EOF, an error or unexpected bytes waiting (a non-blocking
    peek: unlike select() it works for any fd number)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return True  # EOF (b"") or bytes nobody asked for
    except BlockingIOError:
        return False
    except OSError:
        return True


class Conn:
    """One reader connection to a holder. Its parts run one after another on its own thread
    (``queue``), so no part ever waits for another part's lock; ``lock`` guards only the short
    decision whether the caller may send right away (nothing queued) and the submission order."""

    def __init__(self, info: TcpPeerInfo, connect_timeout: float, io_timeout: float, bufsize: int) -> None:
        self.info = info
        self.lock = threading.Lock()
        self.queued = 0  # parts submitted to ``queue`` and not finished; guarded by ``lock``
        self.queue = ThreadPoolExecutor(1, thread_name_prefix=f"pdxfer-tcp-{info.host}:{info.port}")
        self.sock: socket.socket | None = None
        self.connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._bufsize = bufsize

    def ensure(self) -> socket.socket:
        """The live socket, (re)connecting and handshaking if needed. Only the connection's own
        queue thread (or connect(), before any part) calls it."""
        if self.sock is not None:
            # Between requests nothing may arrive: readable means the holder closed (or restarted),
            # so reconnect now instead of failing the read on a stale socket.
            if not is_stale(self.sock):
                return self.sock
            self.drop()
        info = self.info
        deadline = time.monotonic() + self.connect_timeout
        # One retry: a holder under a flood of unauthenticated connections may cut this one while
        # it is still in its handshake (it gives up the oldest); a refusal is final at once.
        for attempt in (1, 2):
            left = max(0.05, deadline - time.monotonic())
            sock = wire.connect_socket(info.host, info.port, left, self._bufsize)
            try:
                sock.settimeout(None)  # recv_by bounds every wait with kernel timeouts instead
                handshake.prove(sock, info.instance, info.secret, deadline, f"{info.host}:{info.port}")
                break
            except (handshake.AuthRefused, handshake.VersionMismatch):
                sock.close()
                raise
            except (OSError, TransportError) as exc:
                sock.close()
                if attempt == 2 or time.monotonic() >= deadline:
                    raise PeerUnreachable(f"handshake with {info.peer_id} failed: {exc}") from exc
        wire.set_io_timeout(sock, self._io_timeout)
        self.sock = sock
        return sock

    def abort(self) -> None:
        """Wake any thread blocked on this socket; the next request reconnects."""
        s = self.sock
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def drop(self) -> None:
        s, self.sock = self.sock, None
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()


class PeerConns:
    def __init__(self, info: TcpPeerInfo, nconns: int, connect_timeout: float, io_timeout: float,
                 bufsize: int) -> None:
        self.info = info
        self.conns = [Conn(info, connect_timeout, io_timeout, bufsize) for _ in range(nconns)]
        self.rr = itertools.count()

