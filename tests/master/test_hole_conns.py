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


def test_connection_cap_refuses_only_when_proven_clients_fill_it_and_logs(masters):
    m = masters.start(extra_args=("--max-connections", "4", "--handshake-timeout", "30"))
    clients = [masters.client(m.address) for _ in range(4)]
    try:
        for c in clients:  # a first request answered: each has proven itself (no token here)
            c.stats()
        wait_until(lambda: _open_connections(m.http_address) == 4, 5, "the master to hold 4 connections")
        with _raw(m.address) as fifth:
            assert _closed_within(fifth, 2.0), "a connection beyond --max-connections was kept"
        wait_until(lambda: "connection limit" in Path(m.log_path).read_text(), 3, "a log line about the limit")
        for c in clients:  # none of the four was cut for it
            assert c.stats()["connections_refused"] >= 1
    finally:
        for c in clients:
            c.close()


def test_silent_sockets_at_the_cap_never_lock_out_a_client_with_the_token(masters):
    """Issue 42, hole 1: silent sockets from one address filling --max-connections used to lock
    every new client out until they timed out (shown on the old code: the token client's connect
    was refused). Now each newcomer cuts the oldest unproven connection, and one address keeps at
    most --max-unproven-per-peer of them."""
    m = masters.start(token="s3cret", extra_args=("--max-connections", "8", "--handshake-timeout", "30",
                                                  "--max-unproven-per-peer", "6"))
    silent = [_raw(m.address) for _ in range(12)]  # more than the cap, all from 127.0.0.1
    try:
        wait_until(lambda: _open_connections(m.http_address) <= 6, 5, "the per-peer cap to cut the oldest")
        t0 = time.monotonic()
        c = masters.client(m.address, token="s3cret")
        c.register_node(node_info("ok"), 30)
        assert c.publish("ok", [(keys_for("flood", 1)[0], [1])]) == 1
        assert c.lookup_and_lock(keys_for("flood", 1), "r", 5.0).hit_chunks == 1
        took = time.monotonic() - t0
        assert took < 1.0, f"a client with the token took {took:.2f} s to connect and look up under the flood"
        stats = c.stats()
        assert stats["unproven_evicted"] >= 6 and stats["connections_refused"] == 0
        # The oldest silent sockets were the ones cut.
        assert all(_closed_within(s, 1.0) for s in silent[:6])
        c.close()
    finally:
        for s in silent:
            s.close()


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


def test_silent_http_sockets_cannot_take_the_masters_file_descriptors(masters):
    """Issue 42, hole 1 (HTTP port): the HTTP port had no cap, so silent sockets there took the
    process's descriptors, which the wire port shares (shown on the old code with the master at
    RLIMIT_NOFILE 96: the token client's connection was refused or reset). Now at most 64 wait."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, hard))  # the child inherits it
    try:
        m = masters.start(token="s3cret")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    host, port = m.http_address.rsplit(":", 1)
    silent = []
    try:
        for _ in range(150):
            silent.append(socket.create_connection((host, int(port)), timeout=3))
        time.sleep(0.3)
        t0 = time.monotonic()
        c = masters.client(m.address, token="s3cret")
        c.register_node(node_info("fd"), 30)
        assert c.publish("fd", [(keys_for("fd", 1)[0], [1])]) == 1
        assert time.monotonic() - t0 < 1.0
        assert c.stats()["http_connections_cut"] >= 150 - 64
        c.close()
    finally:
        for s in silent:
            s.close()
    assert master_value(m.http_address, "pdxfer_master_http_connections_cut_total") >= 150 - 64
