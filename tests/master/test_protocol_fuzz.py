"""Random, truncated, oversized and wrong-version frames against a real master process.

After every bad message the service must still answer other clients correctly, and where the
framing allows an answer it must be an error reply naming what was wrong.
"""

from __future__ import annotations

import json
import random
import socket
import struct

import pytest

from pdxfer.master.wire import protocol as P

from .conftest import keys_for, node_info


def _raw(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    return s


def _read_reply(s: socket.socket) -> tuple[P.Header, dict]:
    data = b""
    while len(data) < P.HEADER_BYTES:
        chunk = s.recv(P.HEADER_BYTES - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    hdr = P.parse_header(data)
    body = b""
    while len(body) < hdr.json_len + hdr.blob_len:
        chunk = s.recv(hdr.json_len + hdr.blob_len - len(body))
        if not chunk:
            raise ConnectionError("closed mid-reply")
        body += chunk
    return hdr, json.loads(body[: hdr.json_len])


def _error_for(addr: str, frame: bytes) -> dict:
    with _raw(addr) as s:
        s.sendall(frame)
        hdr, doc = _read_reply(s)
    assert hdr.op == P.OP_ERROR, doc
    return doc


@pytest.fixture
def served(master, masters):
    """A master with one node and a 4-chunk prompt, plus a checker that it still serves."""
    c = masters.client(master.address)
    c.register_node(node_info("h"), 60)
    keys = keys_for("fuzz", 4)
    c.publish("h", [(k, [i]) for i, k in enumerate(keys)])

    def still_serves() -> None:
        r = c.lookup_and_lock(keys, reader="check")
        assert r.hit_chunks == 4 and r.locations[3].block_ids == [3]
        assert c.release(r.lock_id)

    return master, c, keys, still_serves


def test_named_errors(served):
    master, c, keys, still_serves = served
    addr = master.address
    good = P.encode_frame(P.OP_LOOKUP, 7, {"n": 2, "reader": "x", "ttl": 1.0}, b"".join(keys[:2]))

    wrong_version = good[:2] + bytes([P.PROTOCOL_VERSION + 1]) + good[3:]
    doc = _error_for(addr, wrong_version)
    assert doc["err"] == P.ERR_VERSION and "version" in doc["msg"]

    oversized = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.OP_LOOKUP, 1, 16, P.MAX_BLOB_BYTES + 1)
    doc = _error_for(addr, oversized)
    assert doc["err"] == P.ERR_OVERSIZED and "exceeds" in doc["msg"]

    doc = _error_for(addr, b"XX" + good[2:])
    assert doc["err"] == P.ERR_MALFORMED and "magic" in doc["msg"]

    doc = _error_for(addr, P.encode_frame(P.OP_LOOKUP, 1, {"n": 3, "reader": "x", "ttl": 1.0}, b"".join(keys[:2])))
    assert doc["err"] == P.ERR_MALFORMED and "blob" in doc["msg"]

    doc = _error_for(addr, P.encode_frame(P.OP_LOOKUP, 1, {"n": 1, "reader": 5, "ttl": 1.0}, keys[0]))
    assert doc["err"] == P.ERR_MALFORMED and "'reader'" in doc["msg"]

    doc = _error_for(addr, P.encode_frame(P.OP_PUBLISH, 1, {"node_id": "h", "epoch": 1, "seq": 1, "n": 1, "counts": ["a"]}, keys[0]))
    assert doc["err"] == P.ERR_MALFORMED and "'counts'" in doc["msg"]

    doc = _error_for(addr, P.encode_frame(99, 1, {}))
    assert doc["err"] == P.ERR_UNKNOWN_OP

    body = b"[1,2"
    doc = _error_for(addr, P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, P.OP_STATS, 1, len(body), 0) + body)
    assert doc["err"] == P.ERR_MALFORMED and "JSON" in doc["msg"]

    # a well-framed but bad request keeps the connection usable
    with _raw(addr) as s:
        s.sendall(P.encode_frame(P.OP_RELEASE, 1, {"lock": ""}))
        hdr, doc = _read_reply(s)
        assert hdr.op == P.OP_ERROR and hdr.req_id == 1
        s.sendall(P.encode_frame(P.OP_PING, 2, {}))
        hdr, doc = _read_reply(s)
        assert hdr.op == P.OP_PING | P.REPLY_BIT and hdr.req_id == 2 and doc["leader"] is True
    still_serves()
    assert c.stats()["bad_frames"] >= 8


def test_random_and_truncated_frames(served):
    master, c, keys, still_serves = served
    rng = random.Random(1234)
    valid = [
        P.encode_frame(P.OP_LOOKUP, 3, {"n": 4, "reader": "f", "ttl": 1.0}, b"".join(keys)),
        P.encode_frame(P.OP_PUBLISH, 4, {"node_id": "h", "n": 2, "per": 1}, b"".join(keys[:2]) + struct.pack("<II", 0, 1)),
        P.encode_frame(P.OP_HEARTBEAT, 5, {"node_id": "h"}),
        P.encode_frame(P.OP_STATS, 6, {}),
    ]
    for i in range(120):
        kind = i % 4
        if kind == 0:  # pure noise
            frame = rng.randbytes(rng.randint(1, 200))
        elif kind == 1:  # a valid frame cut short, then the client hangs up
            v = rng.choice(valid)
            frame = v[: rng.randint(1, len(v) - 1)]
        elif kind == 2:  # a valid frame with random bytes flipped
            v = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                v[rng.randrange(len(v))] = rng.randrange(256)
            frame = bytes(v)
        else:  # a valid header followed by random body bytes
            body = rng.randbytes(rng.randint(0, 64))
            frame = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, rng.randint(0, 255), i, len(body), 0) + body
        with _raw(master.address) as s:
            s.settimeout(2)
            try:
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):  # drain whatever answer there is, until the master hangs up
                    pass
            except (ConnectionError, socket.timeout):
                pass
        if i % 20 == 19:
            still_serves()
    still_serves()
    assert master.proc.poll() is None
