"""Issue 9, hole 9 (master part): a peer must not be able to stop the master. Authentication
before any large body is buffered, a bounded wait for a first frame and for each header, and a
cap on concurrent connections that says so in the log. Raw sockets against a real master."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from pdxfer.master.wire import protocol as P

from .conftest import keys_for, master_value, node_info, wait_until


def _raw(addr: str, timeout: float = 3.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the master closed (or reset) the connection within ``seconds``; replies are skipped."""
    s.settimeout(0.1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not s.recv(65536):
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


def _open_connections(http_address: str) -> int:
    """The master's open client connections, read over HTTP (a wire connection would count itself)."""
    return int(master_value(http_address, "pdxfer_master_connections"))


def _reply_header(s: socket.socket, timeout: float) -> P.Header:
    s.settimeout(timeout)
    return P.parse_header(s.recv(P.HEADER_BYTES, socket.MSG_WAITALL))


def test_unauthenticated_peer_cannot_make_the_master_buffer_a_large_body(masters):
    m = masters.start(token="s3cret")
    with _raw(m.address) as s:
        # A header announcing a 17 MiB frame from a peer that never authenticated: refused at
        # once, without waiting for (or allocating) the body.
        s.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.OP_PUBLISH, 1, P.MAX_JSON_BYTES, P.MAX_BLOB_BYTES))
        t0 = time.monotonic()
        try:
            hdr = _reply_header(s, 3.0)
        except TimeoutError:
            pytest.fail("the master waited for the 17 MiB body of an unauthenticated peer")
        assert time.monotonic() - t0 < 2.0
        assert hdr.op == P.OP_ERROR
        assert _closed_within(s, 2.0)
    # a client with the token still works
    c = masters.client(m.address, token="s3cret")
    c.register_node(node_info("ok"), 30)
    assert c.publish("ok", [(keys_for("auth", 1)[0], [1])]) == 1


def test_silent_and_slow_peers_are_dropped(masters):
    m = masters.start(token="s3cret", extra_args=("--handshake-timeout", "0.5"))
    with _raw(m.address) as silent, _raw(m.address) as slow:
        slow.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.OP_HELLO, 1, 10, 0)[:8])  # half a header
        assert _closed_within(silent, 3.0), "a peer that sends nothing holds its connection forever"
        assert _closed_within(slow, 3.0), "a peer that sends half a header holds its connection forever"


def test_connection_cap_refuses_and_logs(masters):
    m = masters.start(extra_args=("--max-connections", "4", "--handshake-timeout", "30"))
    held = [_raw(m.address) for _ in range(4)]
    try:
        wait_until(lambda: _open_connections(m.http_address) == 4, 5, "the master to hold 4 connections")
        with _raw(m.address) as fifth:
            assert _closed_within(fifth, 2.0), "a connection beyond --max-connections was kept"
        wait_until(lambda: "connection limit" in Path(m.log_path).read_text(), 3, "a log line about the limit")
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    c = masters.client(m.address)
    assert c.stats()["connections_refused"] >= 1


def test_trickled_body_is_dropped_at_its_bound(masters):
    # A hello header, then its body a byte at a time: each byte arrives well inside the bound, but
    # the whole body does not, so the connection must go (the bound runs from the header).
    m = masters.start(token="s3cret", extra_args=("--handshake-timeout", "0.6"))
    body = b'{"tok":"s3cret"}' + b" " * 40
    with _raw(m.address) as s:
        s.sendall(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.OP_HELLO, 1, len(body), 0))
        t0 = time.monotonic()
        closed = False
        for b in body:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            if _closed_within(s, 0.1):
                closed = True
                break
        assert closed, "a peer trickling its hello body held the connection past the handshake bound"
        assert time.monotonic() - t0 < 2.0
