"""pdxfer.common.netio: exact reads over real sockets, EOF part-way named with how far it got."""

from __future__ import annotations

import socket
import threading

import pytest

from pdxfer.common import netio


def test_recv_exact_joins_pieces_sent_apart():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        sender = threading.Thread(target=lambda: [b.sendall(p) for p in (b"ab", b"cdef", b"gh", b"tail")])
        sender.start()
        assert netio.recv_exact(a, 8, "frame") == b"abcdefgh"
        sender.join(5)
        assert netio.recv_exact(a, 4, "frame") == b"tail"  # nothing beyond n was consumed


def test_eof_part_way_raises_the_given_error_naming_what_and_progress():
    class Dead(RuntimeError):
        pass

    a, b = socket.socketpair()
    with a:
        a.settimeout(5)
        b.sendall(b"xyz")
        b.close()
        with pytest.raises(Dead, match=r"reading header \(3 of 8 bytes\)"):
            netio.recv_exact(a, 8, "header", Dead)


def test_default_error_is_a_connection_error_and_views_fill_in_place():
    a, b = socket.socketpair()
    with a:
        a.settimeout(5)
        buf = bytearray(10)
        b.sendall(b"0123456789")
        netio.recv_exact_into(a, memoryview(buf)[2:6], "slice")
        assert buf == bytearray(2) + b"0123" + bytearray(4)
        b.close()
        with pytest.raises(ConnectionError):
            netio.recv_exact(a, 100, "rest")
