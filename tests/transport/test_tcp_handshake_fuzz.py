"""Random, mutated, truncated and wrong-version handshakes against a real TCP holder.

Every case runs on its own real socket to a TcpTransport in this process. Whatever a peer sends,
what comes back is a challenge and at most one refusal (ERR_AUTH, or ERR_VERSION for a proof of
another version) with a zero mac, and then the holder closes: never an OK verdict, a response
frame, the instance id, the secret or a byte of memory. Only the untouched proof is admitted,
and the holder still serves a real reader after all of it.
"""

from __future__ import annotations

import os
import random
import socket
import time

import numpy as np
import pytest

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.transport.base import ReadState, RegisteredRegion
from pdxfer.transport.tcp import TcpTransport, handshake, parse_metadata, wire

pytestmark = pytest.mark.timeout(180)

SIZE = 1 << 14
CASES = 400


@pytest.fixture(scope="module")
def holder():
    buf = (np.arange(SIZE, dtype=np.uint32) * 40503 + 11).astype(np.uint8)
    t = TcpTransport(hello_timeout=0.5)
    t.register([RegisteredRegion(0, buf.ctypes.data, buf.nbytes)])
    info = parse_metadata(t.metadata())
    yield t, info, buf
    t.close()


def _open(info) -> tuple[socket.socket, bytes, bytes]:
    s = socket.create_connection((info.host, info.port), timeout=5)
    challenge = wire.recv_exact(s, handshake.CHALLENGE_SIZE, "challenge")
    nonce = handshake._CHALLENGE.unpack(wire._unseal(challenge, "challenge"))[3]
    return s, challenge, nonce


def _valid_proof(info, nonce: bytes) -> bytes:
    mine = os.urandom(handshake.NONCE_BYTES)
    return handshake.pack_proof(mine, handshake.mac(info.secret, b"pdxfer-tcp reader", info.instance, nonce, mine))


def _rest(s: socket.socket, within: float = 3.0) -> bytes:
    s.settimeout(within)
    out = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    raise AssertionError("holder kept the connection open after a bad handshake")


def _mutations(rng: random.Random, proof: bytes) -> tuple[str, bytes]:
    """One hostile variant of a valid proof (or plain garbage), named for the failure message."""
    kind = rng.choice(["garbage", "flip", "flip-resealed", "truncated", "extended", "other-version",
                       "request-instead", "zero-mac"])
    if kind == "garbage":
        return kind, os.urandom(rng.randrange(0, 3 * handshake.PROOF_SIZE))
    if kind == "flip":
        i = rng.randrange(len(proof))
        return kind, proof[:i] + bytes([proof[i] ^ (1 << rng.randrange(8))]) + proof[i + 1:]
    if kind == "flip-resealed":  # a correct CRC around a wrong nonce or mac: only the mac can tell
        head = bytearray(proof[:-4])
        i = rng.randrange(8, len(head))
        head[i] ^= 1 << rng.randrange(8)
        return kind, wire._seal(bytes(head))
    if kind == "truncated":
        return kind, proof[:rng.randrange(len(proof))]
    if kind == "extended":  # a valid proof's bytes shifted by junk in front
        return kind, os.urandom(rng.randrange(1, 8)) + proof
    if kind == "other-version":
        v = rng.choice([0, 1, wire.WIRE_VERSION + 1, 0xFFFF])
        return kind, handshake.pack_proof(proof[8:40], proof[40:72], version=v)
    if kind == "request-instead":
        return kind, wire.pack_request(1, [(0, 0, 64)])
    return kind, handshake.pack_proof(proof[8:40], bytes(32))


def test_fuzzed_handshakes_are_refused_without_a_word_more(holder):
    t, info, buf = holder
    rng = random.Random(19)
    seen: dict[str, int] = {}
    for case in range(CASES):
        s, challenge, nonce = _open(info)
        kind, data = _mutations(rng, _valid_proof(info, nonce))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # nothing more comes: a holder waiting for bytes sees EOF
        except OSError:
            pass  # the holder may already have refused and closed
        rest = _rest(s)
        s.close()
        seen[kind] = seen.get(kind, 0) + 1
        where = f"case {case} ({kind}): sent {data.hex()}, got {rest.hex()}"
        assert rest in (b"", handshake.pack_verdict(wire.ERR_AUTH), handshake.pack_verdict(wire.ERR_VERSION)), where
        if kind == "other-version" and data[4:6] != wire.WIRE_VERSION.to_bytes(2, "little"):
            assert rest == handshake.pack_verdict(wire.ERR_VERSION), where
        if kind in ("flip-resealed", "zero-mac", "request-instead"):
            assert rest == handshake.pack_verdict(wire.ERR_AUTH), where
        for secret_thing in (info.instance, info.secret, buf[:32].tobytes()):
            assert secret_thing not in challenge + rest, where
    assert len(seen) == 8, seen  # every kind of mutation ran
    # The untouched proof is admitted and its connection serves exact bytes.
    s, _challenge, nonce = _open(info)
    s.sendall(_valid_proof(info, nonce))
    status = handshake._VERDICT.unpack(wire._unseal(wire.recv_exact(s, handshake.VERDICT_SIZE, "v"), "v"))[2]
    assert status == wire.OK
    s.sendall(wire.pack_request(7, [(0, 0, SIZE)]))
    st, rid, length, _f = wire.unpack_response(wire.recv_exact(s, wire.RESP_SIZE, "response"))
    assert (st, rid, length) == (wire.OK, 7, SIZE)
    assert wire.recv_exact(s, SIZE, "payload") == buf.tobytes()
    s.close()
    # And the transport's own reader still reads after the storm.
    dst = np.zeros(SIZE, dtype=np.uint8)
    r = TcpTransport()
    try:
        r.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
        peer = r.connect(t.metadata(), timeout=5)
        assert r.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, SIZE),), 1)).wait(5) is ReadState.DONE
        assert np.array_equal(dst, buf)
    finally:
        r.close()


def test_fuzzed_challenges_and_verdicts_fail_the_reader_with_a_typed_error():
    """The reader's side of the handshake against a stand-in holder sending hostile frames:
    a typed TransportError every time, within the deadline, never a pass."""
    from pdxfer.transport.base import TransportError

    rng = random.Random(7)
    instance, secret = os.urandom(16), os.urandom(32)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        for case in range(60):
            r = socket.create_connection(("127.0.0.1", port), timeout=5)
            c, _ = srv.accept()
            nonce = os.urandom(32)
            good_challenge = handshake.pack_challenge(nonce)
            if rng.random() < 0.5:  # a hostile challenge
                i = rng.randrange(len(good_challenge))
                first = good_challenge[:i] + bytes([good_challenge[i] ^ 0x10]) + good_challenge[i + 1:]
                verdict = b""
            else:  # a fine challenge, then a hostile verdict
                first = good_challenge
                verdict = rng.choice([handshake.pack_verdict(wire.OK, os.urandom(32)),
                                      handshake.pack_verdict(wire.ERR_AUTH),
                                      os.urandom(handshake.VERDICT_SIZE),
                                      handshake.pack_verdict(wire.OK)[:-1]])
            c.sendall(first + verdict)
            c.shutdown(socket.SHUT_WR)
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                handshake.prove(r, instance, secret, time.monotonic() + 2, "stand-in")
            assert time.monotonic() - t0 < 2.5, f"case {case}"
            r.close()
            c.close()
    finally:
        srv.close()
