"""One connection of the master client to a master, carrying one framed request and its reply at
a time. Its TCP (or TLS) socket's timeouts follow the call's deadline.

MasterClient (master_client.py) pools these, one per concurrent caller, and decides what a failure
means (retry, follow the leader, give up); a connection only reports how it failed.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import struct
import time
from typing import Any

from pdxfer.common import netio
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.tls import CLIENT_ENV, ClientTls, looks_like_tls

_RECV_BYTES = 1 << 16


# Keeps its leading underscore: MasterClient's errors carry ``repr()`` of it ("_Closed(...)"), and
# a rename would change their text.
class _Closed(Exception):
    """The master closed the connection before its reply was complete."""


class PlainToTls(Exception):
    """A plain client got a TLS record back: the master serves TLS."""


class Unsendable(Exception):
    """The request cannot be encoded: nothing was sent, the connection is still good."""


class MasterConn:
    """``used``: it carried a request before the current one (its hello aside), so a failure on it
    may be a master that closed it while it sat in the pool: worth one retry on a fresh one."""

    def __init__(self, addr: tuple[str, int], timeout: float, tls: ClientTls | None,
                 ctx: ssl.SSLContext | None, slack: float) -> None:
        self.addr = addr
        self.slack = slack
        sock = socket.create_connection(addr, timeout=max(timeout, 0.001))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is not None:
            assert tls is not None
            try:  # the handshake runs under the connect timeout: a peer that stays silent cannot hold it
                sock = ctx.wrap_socket(sock, server_hostname=tls.server_name or addr[0])
            except BaseException:
                sock.close()
                raise
        self.sock = sock
        self.sock_timeout = sock.gettimeout() or 0.0
        # A plain socket waits in blocking mode under the kernel's own send and receive timeouts:
        # Python's socket timeouts poll before every send and receive, a system call each that a
        # busy client pays twice per request. TLS sockets keep Python's timeouts.
        self.kernel_timeouts = ctx is None
        if self.kernel_timeouts:
            sock.settimeout(None)
            self._set_kernel_timeout(self.sock_timeout)
        self.ids = itertools.count(1)
        self.used = False

    def _bound(self, deadline: float) -> None:
        """Keep the socket's timeout within ``slack`` of the time left: each change is a system
        call, and on a busy client every call would make one per send and receive."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the call's deadline passed")
        if abs(left - self.sock_timeout) > self.slack:
            if self.kernel_timeouts:
                self._set_kernel_timeout(left)
            else:
                self.sock.settimeout(left)
            self.sock_timeout = left

    def _set_kernel_timeout(self, t: float) -> None:
        sec = int(t)
        usec = int((t - sec) * 1e6) or 1  # never (0, 0): that means no timeout at all
        tv = struct.pack("ll", sec, usec)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def request(self, op: int, doc: dict[str, Any], blob: bytes, deadline: float) -> tuple[int, dict[str, Any], bytes]:
        try:
            return self._exchange(op, doc, blob, deadline)
        except BlockingIOError:  # a kernel timeout ran out: the same as Python's socket timeout
            raise socket.timeout("timed out waiting for the master") from None

    def _exchange(self, op: int, doc: dict[str, Any], blob: bytes, deadline: float) -> tuple[int, dict[str, Any], bytes]:
        req_id = next(self.ids) & 0xFFFFFFFF
        try:
            frame = P.encode_frame(op, req_id, doc, blob)
        except ValueError as exc:
            raise Unsendable(str(exc)) from None
        self._bound(deadline)
        self.sock.sendall(frame)
        self.used = True
        self._bound(deadline)
        # One recv usually brings the whole reply (header and body): not one call for each.
        data = self.sock.recv(_RECV_BYTES)
        while len(data) < P.HEADER_BYTES:
            self._bound(deadline)
            more = self.sock.recv(_RECV_BYTES)
            if not more:
                raise _Closed(f"connection closed while reading master reply ({len(data)} of {P.HEADER_BYTES} "
                              "header bytes)")
            data += more
        if looks_like_tls(data) and not isinstance(self.sock, ssl.SSLSocket):
            raise PlainToTls("the master answered with a TLS record: it serves TLS but this client is plain; "
                              f"give ca_file (${CLIENT_ENV['ca_file']}) to connect with TLS")
        hdr = P.parse_header(data[: P.HEADER_BYTES])
        need = P.HEADER_BYTES + hdr.json_len + hdr.blob_len
        if len(data) > need:
            raise P.ProtocolError(P.ERR_MALFORMED, f"{len(data) - need} bytes after the reply to request {req_id}")
        body = data[P.HEADER_BYTES :]
        if len(data) < need:
            body += netio.recv_exact(self.sock, need - len(data), "master reply", _Closed,
                                     before_recv=lambda: self._bound(deadline))
        # Request id 0: a refusal the master sent before reading any request (no client certificate).
        if hdr.req_id != req_id and not (hdr.op == P.OP_ERROR and hdr.req_id == 0):
            raise P.ProtocolError(P.ERR_MALFORMED, f"reply to request {hdr.req_id}, expected {req_id}")
        return hdr.op, P.decode_json(body[: hdr.json_len]), body[hdr.json_len :]
