"""What lets a peer read a holder's memory (its transport metadata: for NIXL the agent blob with
the registered regions' remote keys, for TCP the endpoint and the data-plane secret) reaches
only master clients that presented the token. Raw sockets against a real master: every op the
wire knows, unauthenticated, with a wrong token, and with a wrong hello pipelined in front of a
request; the bytes that come back must never contain the holder's metadata."""

from __future__ import annotations

import base64
import os
import socket
import time
import urllib.request

from pdxfer.master import NodeInfo
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops

from .conftest import keys_for

TOKEN = "s3cret-token"


def _raw(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=3)


def _drain(s: socket.socket, seconds: float = 2.0) -> bytes:
    """Everything the master sends until it closes the connection (bounded)."""
    got = b""
    s.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if not chunk:
            break
        got += chunk
    return got


def _leaks(secret: bytes, got: bytes) -> bool:
    """The metadata travels base64-encoded inside the JSON descriptions; look for both forms."""
    return secret in got or base64.b64encode(secret) in got or b"holder" in got


def _frame(req: ops.Request, req_id: int = 7) -> bytes:
    return P.encode_frame(req.op, req_id, req.doc, req.blob)


def _requests(keys: list[bytes]) -> list[bytes]:
    """One well-formed frame per request op, as an authenticated client would send it."""
    joined = P.join_keys(keys)
    reqs = [
        ops.encode_lookup(joined, "spy", 5.0, {}),
        ops.encode_peek(joined, {}),
        ops.encode_nodes(),
        ops.encode_stats(),
        ops.encode_ping(),
        ops.encode_register(NodeInfo("spy", 0, "tcp", b"x", {"v": 1}, "fp"), 5.0),
        ops.encode_heartbeat("holder", 1),
        ops.encode_deregister("holder", 1),
        ops.encode_publish("holder", [(keys[0], [9])], None, 1, 1),
        ops.encode_release("x"),
        ops.encode_unpublish("holder", keys, 1),
        ops.encode_fence("holder", 1, 1),
        ops.encode_status(),
    ]
    assert {r.op for r in reqs} | {P.OP_HELLO} == set(P.OP_NAMES), "a new op: add it here so its refusal is checked"
    return [_frame(r) for r in reqs]


def test_holder_metadata_reaches_only_clients_with_the_token(masters):
    m = masters.start(token=TOKEN)
    secret = b"NIXL-AGENT-MD-" + os.urandom(16).hex().encode()
    good = masters.client(m.address, token=TOKEN)
    good.register_node(NodeInfo("holder", 0, "nixl", secret, {"v": 1, "block_size": 16}, "fp-test"), 30)
    keys = keys_for("secrecy", 2)
    assert good.publish("holder", [(keys[0], [1]), (keys[1], [2])]) == 2

    # The oracle can see the metadata: an authenticated lookup carries it.
    with _raw(m.address) as s:
        s.sendall(_frame(ops.encode_hello(TOKEN), 1) + _frame(ops.encode_lookup(P.join_keys(keys), "ok", 5.0, {}), 2)
                  + _frame(ops.encode_nodes(), 3))
        time.sleep(0.5)
        s.settimeout(2)
        seen = s.recv(1 << 20)
    assert _leaks(secret, seen) and base64.b64encode(secret) in seen, "the authenticated control did not see the metadata: the check below proves nothing"

    failures_before = good.stats()["auth_failures"]
    attempts = 0
    for frame in _requests(keys):
        # No hello at all: refused, closed.
        with _raw(m.address) as s:
            s.sendall(frame)
            got = _drain(s)
            assert not _leaks(secret, got)
            assert P.parse_header(got[: P.HEADER_BYTES]).op == P.OP_ERROR
            attempts += 1
        # A wrong hello with the request pipelined behind it in the same write.
        with _raw(m.address) as s:
            s.sendall(_frame(ops.encode_hello("guess"), 1) + frame)
            got = _drain(s)
            assert not _leaks(secret, got)
            attempts += 1
    assert good.stats()["auth_failures"] - failures_before == attempts

    # The HTTP side (no token there) shows counts, never descriptions.
    for path in ("/metrics", "/health"):
        with urllib.request.urlopen(f"http://{m.http_address}{path}", timeout=3) as r:
            body = r.read()
        assert not _leaks(secret, body)

    # Nothing was lost for the real clients.
    r = good.lookup_and_lock(keys, reader="after")
    assert r.hit_chunks == 2 and good.release(r.lock_id)
