"""Socket helpers every part may use (transport, probe, master): nothing here knows a protocol.

Kept below both transport and master, since master must not import transport.
"""

from __future__ import annotations

import socket
from typing import Callable


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before the expected bytes arrived."""


def recv_exact_into(sock: socket.socket, view: memoryview, what: str,
                    closed: Callable[[str], Exception] = ConnectionClosed, flags: int = 0,
                    before_recv: Callable[[], None] | None = None) -> None:
    """Fill ``view`` from ``sock``; EOF part-way raises ``closed(message)`` naming ``what`` and how
    far it got. Waits are bounded by the socket's own timeout (a timeout raises as usual).
    ``before_recv``: called before each receive (e.g. to fit the socket's timeout to a deadline,
    so a peer sending a byte at a time cannot stretch the whole read)."""
    n = len(view)
    got = 0
    while got < n:
        if before_recv is not None:
            before_recv()
        k = sock.recv_into(view[got:], n - got, flags)
        if k == 0:
            raise closed(f"connection closed while reading {what} ({got} of {n} bytes)")
        got += k


def recv_exact(sock: socket.socket, n: int, what: str,
               closed: Callable[[str], Exception] = ConnectionClosed,
               before_recv: Callable[[], None] | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (see :func:`recv_exact_into`)."""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), what, closed, before_recv=before_recv)
    return bytes(buf)
