"""One client connection of the master: framing, authentication order, timeouts, backpressure.

An ``asyncio.Protocol`` with its own framing buffer rather than streams: a streams server pays for
``asyncio.wait_for`` (a task each on Python 3.11) around every header and body read and several
event-loop turns per request; here a request is answered inside the ``data_received`` call that
completed it. Timeouts are one ``loop.call_at`` handle per connection, moved only when a deadline
comes earlier than the one it is armed for (a later deadline is checked when the handle fires).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any, cast

from pdxfer.master.wire import protocol as P

if TYPE_CHECKING:
    from pdxfer.master.server.master_service import MasterService

log = logging.getLogger("pdxfer.master")

BODY_TIMEOUT_S = 10.0  # a client that sent a header must send the body within this

# What the connection is waiting for; each has its own timeout and its own way of ending.
_FIRST = 0  # a first frame (or, with a token, any frame before a hello succeeded)
_NEXT = 1  # the next request of an authenticated connection (idle timeout)
_BODY = 2  # the rest of a frame whose header arrived


class MasterConnection(asyncio.Protocol):
    def __init__(self, svc: MasterService) -> None:
        self.svc = svc
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.authed = svc.token is None  # with a token, only a hello is read until one succeeds
        self.buf = bytearray()
        self.hdr: P.Header | None = None  # header of the frame whose body is awaited
        self.state = _FIRST
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.paused = False  # the peer does not read its replies: stop reading its requests
        self.done = False
        self.proven = False  # a hello accepted (with a token) or a first request answered (without)

    # ---- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, so no isinstance check).
        self.transport = cast(asyncio.Transport, transport)
        self.peer = transport.get_extra_info("peername")
        svc = self.svc
        host = str(self.peer[0]) if isinstance(self.peer, tuple) and self.peer else str(self.peer)
        cut = svc._slots.make_room(host)
        if cut is None:  # proven clients fill every slot
            self.done = True
            svc._refuse_connection(self.peer, transport)
            return
        for victim in cut:
            svc._evict_unproven(victim, self.peer)
        svc._conns.add(self)
        svc._slots.add(self, host)
        _keepalive(transport.get_extra_info("socket"))
        if svc.require_client_cert and not transport.get_extra_info("peercert"):
            svc.tls_refusals += 1
            log.warning("refused %s: no TLS client certificate (--tls-client-ca requires one)", self.peer)
            transport.write(P.encode_frame(P.OP_ERROR, 0, {
                "err": P.ERR_AUTH, "msg": "TLS client certificate required: this connection presented none "
                "(the master requires one signed by its --tls-client-ca)"}))
            self.close()
            return
        # The first frame must come soon: a peer that connects and sends nothing, or half a
        # header, must not hold a connection.
        self._wait(_FIRST, svc.handshake_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        if self.buf:
            self.buf += data
            data = self.buf
            self.buf = bytearray()
        rest = self._process(data)
        if rest:
            self.buf += rest

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost says whether a frame was cut

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.svc._conns.discard(self)
        self.svc._slots.remove(self)
        if not self.done and self.hdr is not None:
            self.svc.bad_frames += 1
            log.warning("client %s closed mid-frame (truncated message)", self.peer)
        self.done = True

    def pause_writing(self) -> None:
        # A peer that sends requests but does not read the replies must not make the master
        # buffer them without bound: read nothing more from it until its replies drained.
        self.paused = True
        if self.transport is not None and not self.done:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.done:
            self.transport.resume_reading()
            if self.buf:
                data, self.buf = self.buf, bytearray()
                self.buf += self._process(data)

    # ---- framing --------------------------------------------------------------------------------

    def _process(self, data: bytes | bytearray) -> bytes | bytearray:
        """Answer every complete frame in ``data``, in order; what is left of it (a partial frame,
        or frames not read yet while the peer's replies are backed up)."""
        svc = self.svc
        off = 0
        size = len(data)
        while not self.done and not self.paused:
            hdr = self.hdr
            if hdr is None:
                if size - off < P.HEADER_BYTES:
                    break
                raw = bytes(data[off : off + P.HEADER_BYTES])
                off += P.HEADER_BYTES
                if not self._header(raw):
                    return b""
                hdr = self.hdr
                assert hdr is not None
            n = hdr.json_len + hdr.blob_len
            if size - off < n:
                if self.state != _BODY:  # the body's bound runs from its header, not per chunk
                    self._wait(_BODY, self._body_timeout())
                break
            body = bytes(data[off : off + n])
            off += n
            self.hdr = None
            if hdr.op == P.OP_HELLO:
                reply, keep = svc._hello(hdr, body, self.peer)
                self.authed = self.authed or keep
            else:
                reply, keep = svc._handle(hdr, body, self.peer)
            self.transport.write(reply)  # type: ignore[union-attr]
            if not keep:
                self.close()
                return b""
            if not self.proven and self.authed:
                self.proven = True
                svc._slots.prove(self)
            if self.authed:
                self._wait(_NEXT, svc.idle_timeout_s)
            else:
                self._wait(_FIRST, svc.handshake_timeout_s)
        return data[off:] if off < size else b""

    def _body_timeout(self) -> float:
        return BODY_TIMEOUT_S if self.authed else min(BODY_TIMEOUT_S, self.svc.handshake_timeout_s)

    def _header(self, raw: bytes) -> bool:
        """Take a header (False: refused, the connection is closing)."""
        try:
            hdr = P.parse_header(raw)
            if not self.authed:
                self.svc._check_preauth(hdr, self.peer)
        except P.ProtocolError as exc:
            # Framing cannot be trusted after a bad header, and an unauthenticated peer's body is
            # never read: answer, then hang up.
            if exc.code != P.ERR_AUTH:
                self.svc.bad_frames += 1
                log.warning("bad frame from %s: %s", self.peer, exc)
            req_id = int.from_bytes(raw[4:8], "big")
            self.transport.write(P.encode_frame(P.OP_ERROR, req_id, {"err": exc.code, "msg": str(exc)}))  # type: ignore[union-attr]
            self.close()
            return False
        self.hdr = hdr
        return True

    def close(self) -> None:
        """Hang up once what was written is sent (a refusal reaches the peer)."""
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.svc._conns.discard(self)
        self.svc._slots.remove(self)
        self.transport.close()  # type: ignore[union-attr]

    # ---- timeouts -------------------------------------------------------------------------------

    def _wait(self, state: int, seconds: float) -> None:
        self.state = state
        self.deadline = deadline = self.loop.time() + seconds
        if self.timer is None or deadline < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = deadline
            self.timer = self.loop.call_at(deadline, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.done:
            return
        if self.loop.time() < self.deadline:  # moved later since armed: wait for the rest
            self.timer_at = self.deadline
            self.timer = self.loop.call_at(self.deadline, self._timed_out)
            return
        svc = self.svc
        if self.state == _BODY:
            svc.bad_frames += 1
            hdr = self.hdr
            log.warning("client %s sent a header but not its %d-byte body within %.1f s", self.peer,
                        hdr.json_len + hdr.blob_len if hdr else 0, self._body_timeout())
            self.hdr = None
        elif self.state == _FIRST:
            svc.handshake_timeouts += 1
            log.info("closing %s: no complete first frame within %.1f s", self.peer, svc.handshake_timeout_s)
        self.close()


def _keepalive(sock: socket.socket | None) -> None:
    """TCP keepalive on a client connection: a peer that vanished (host down, cable cut) is noticed
    within about a minute instead of holding its connection until the idle timeout."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):  # Linux names; other systems keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass
