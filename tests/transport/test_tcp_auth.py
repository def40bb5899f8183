"""The TCP holder serves only readers that prove the secret in its current metadata.

Real holders (TcpTransport in this process or in its own), real sockets. A reader with a guessed
secret, or with the secret of an earlier transport instance on the same port, or of an earlier
registration of the same transport, gets no byte of the holder's memory and learns nothing: not
the instance id, not the region table; the real reader reads exact bytes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import ReadState, RegisteredRegion
from pdxfer.transport.tcp import TcpTransport, handshake, parse_metadata, wire

from .conftest import MiB, Reader, start_holder

pytestmark = pytest.mark.timeout(120)

SIZE = 1 << 16


class LocalHolder:
    """A TcpTransport holding SIZE bytes of a known pattern, in this process."""

    def __init__(self, port: int = 0, fill: int = 7) -> None:
        self.buf = (np.arange(SIZE, dtype=np.uint32) * 2654435761 + fill).astype(np.uint8)
        self.t = TcpTransport(listen_port=port)
        self.t.register([RegisteredRegion(0, self.buf.ctypes.data, self.buf.nbytes)])
        self.meta = self.t.metadata()
        self.info = parse_metadata(self.meta)

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def holder():
    h = LocalHolder()
    yield h
    h.close()


@pytest.fixture
def dst_reader():
    dst = np.full(SIZE, 0xA5, dtype=np.uint8)
    t = TcpTransport()
    t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
    yield t, dst
    t.close()


def with_secret(meta: bytes, secret: bytes) -> bytes:
    doc = json.loads(meta)
    doc["secret"] = secret.hex()
    return json.dumps(doc).encode()


def everything_sent(s: socket.socket, within: float = 3.0) -> bytes:
    """Every byte the holder sends on ``s`` until it closes (fails if it does not close in time)."""
    s.settimeout(within)
    out = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    raise AssertionError("the holder kept an unauthenticated connection open")


def assert_refused_silently(got: bytes, holder: LocalHolder, status: int = wire.ERR_AUTH) -> None:
    """A challenge (a fresh nonce), one refusal with a zero mac, nothing else."""
    assert len(got) == handshake.CHALLENGE_SIZE + handshake.VERDICT_SIZE, got
    challenge, verdict = got[:handshake.CHALLENGE_SIZE], got[handshake.CHALLENGE_SIZE:]
    magic, version, _pad = handshake._PREFIX.unpack_from(challenge)
    assert (magic, version) == (handshake.MAGIC_CHALLENGE, wire.WIRE_VERSION)
    assert verdict == handshake.pack_verdict(status)
    for secret_thing in (holder.info.instance, holder.info.secret, holder.buf[:64].tobytes()):
        assert secret_thing not in got


def _read_all(t: TcpTransport, meta: bytes) -> ReadState:
    peer = t.connect(meta, timeout=5)
    return t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, SIZE),), 1)).wait(5)


def test_the_real_reader_reads_exact_bytes(holder, dst_reader):
    t, dst = dst_reader
    assert _read_all(t, holder.meta) is ReadState.DONE
    assert np.array_equal(dst, holder.buf)


def test_a_guessed_secret_gets_no_byte_and_learns_nothing(holder, dst_reader):
    t, dst = dst_reader
    with pytest.raises(handshake.AuthRefused) as exc:
        _read_all(t, with_secret(holder.meta, os.urandom(32)))
    assert holder.info.instance.hex()[:8] not in str(exc.value)
    assert (dst == 0xA5).all(), "bytes landed from a holder that refused the reader"
    # On the wire: what a raw peer with the guessed secret receives, byte for byte.
    s = socket.create_connection((holder.info.host, holder.info.port), timeout=5)
    challenge = wire.recv_exact(s, handshake.CHALLENGE_SIZE, "challenge")
    nonce = handshake._CHALLENGE.unpack(wire._unseal(challenge, "challenge"))[3]
    mine = os.urandom(32)
    s.sendall(handshake.pack_proof(mine, handshake.mac(os.urandom(32), b"pdxfer-tcp reader",
                                                       holder.info.instance, nonce, mine)))
    s.sendall(wire.pack_request(1, [(0, 0, 64)]))  # asking anyway after the proof
    got = challenge + everything_sent(s)
    s.close()
    assert_refused_silently(got, holder)


def test_a_stale_secret_from_an_earlier_instance_on_the_same_port_gets_nothing(dst_reader):
    t, dst = dst_reader
    first = LocalHolder()
    old_meta, port = first.meta, first.info.port
    first.close()
    second = LocalHolder(port=port, fill=99)
    try:
        with pytest.raises(handshake.AuthRefused, match="stale") as exc:
            _read_all(t, old_meta)
        assert second.info.instance.hex()[:8] not in str(exc.value)
        assert (dst == 0xA5).all()
        assert _read_all(t, second.meta) is ReadState.DONE
        assert np.array_equal(dst, second.buf)
    finally:
        second.close()


def test_a_new_registration_retires_the_old_secret_and_cuts_its_readers(holder, dst_reader):
    t, dst = dst_reader
    assert _read_all(t, holder.meta) is ReadState.DONE
    old_meta = holder.meta
    holder.t.deregister()
    holder.buf[:] = 42
    holder.t.register([RegisteredRegion(0, holder.buf.ctypes.data, holder.buf.nbytes)])
    new_meta = holder.t.metadata()
    assert parse_metadata(new_meta).secret != parse_metadata(old_meta).secret
    dst[:] = 0xA5
    peer = t.connect(old_meta, timeout=5)  # still known to the reader; its connections were cut
    with pytest.raises(handshake.AuthRefused):
        t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, SIZE),), 1)).wait(5)
    assert (dst == 0xA5).all()
    assert _read_all(t, new_meta) is ReadState.DONE  # same peer id, new metadata: starts over
    assert (dst == 42).all()


def test_requests_before_the_handshake_are_never_answered(holder):
    """A peer that skips the proof and sends requests (in range and out of range) gets the
    challenge and a refusal: no response frame, no payload, no region size in an error."""
    s = socket.create_connection((holder.info.host, holder.info.port), timeout=5)
    s.sendall(wire.pack_request(1, [(0, 0, 64)]) + wire.pack_request(2, [(0, SIZE, 1 << 30)]))
    got = everything_sent(s)
    s.close()
    assert_refused_silently(got, holder)
    assert str(SIZE).encode() not in got


def test_another_wire_version_is_named_on_both_sides(holder):
    s = socket.create_connection((holder.info.host, holder.info.port), timeout=5)
    wire.recv_exact(s, handshake.CHALLENGE_SIZE, "challenge")
    s.sendall(handshake.pack_proof(bytes(32), bytes(32), version=wire.WIRE_VERSION + 1))
    got = everything_sent(s)
    s.close()
    assert got == handshake.pack_verdict(wire.ERR_VERSION)
    # A reader meeting a holder of another version: the challenge says so before anything else.
    srv = socket.create_server(("127.0.0.1", 0))

    def future_holder() -> None:
        c, _ = srv.accept()
        c.sendall(wire._seal(handshake._CHALLENGE.pack(handshake.MAGIC_CHALLENGE, 9, 0, bytes(32))))
        time.sleep(0.5)
        c.close()

    th = threading.Thread(target=future_holder, daemon=True)
    th.start()
    r = socket.create_connection(("127.0.0.1", srv.getsockname()[1]), timeout=5)
    with pytest.raises(handshake.VersionMismatch, match="holder speaks TCP wire version 9, this side speaks 2"):
        handshake.prove(r, holder.info.instance, holder.info.secret, time.monotonic() + 5, "h")
    r.close()
    th.join(5)
    srv.close()


def test_a_process_that_cannot_prove_the_secret_is_not_taken_for_the_holder(holder):
    """The holder proves the secret too: a stand-in at the address that says OK to any proof is
    refused by the reader before it sends a request."""
    srv = socket.create_server(("127.0.0.1", 0))
    seen = []

    def impostor() -> None:
        c, _ = srv.accept()
        c.sendall(handshake.pack_challenge(bytes(32)))
        wire.recv_exact(c, handshake.PROOF_SIZE, "proof")
        c.sendall(handshake.pack_verdict(wire.OK, os.urandom(32)))
        c.settimeout(2)
        try:
            seen.append(c.recv(64))
        except OSError:
            seen.append(b"")
        c.close()

    th = threading.Thread(target=impostor, daemon=True)
    th.start()
    r = socket.create_connection(("127.0.0.1", srv.getsockname()[1]), timeout=5)
    with pytest.raises(handshake.AuthRefused, match="not the holder"):
        handshake.prove(r, holder.info.instance, holder.info.secret, time.monotonic() + 5, "h")
    r.close()
    th.join(5)
    srv.close()
    assert seen == [b""], "the reader sent a request to a holder that did not prove the secret"


def test_a_holder_process_refuses_a_guessed_secret_and_serves_the_real_reader(procs):
    """The same across processes, with the region table of the conformance suite's holder."""
    h = start_holder("tcp", sizes=(4 * MiB, 4096))
    procs.append(h.proc)
    guessed = Reader("tcp", MiB)
    try:
        with pytest.raises(handshake.AuthRefused):
            guessed.t.connect(with_secret(h.meta, os.urandom(32)), timeout=5)
        assert (guessed.raw == 0xA5).all()
    finally:
        guessed.close()
    real = Reader("tcp", MiB)
    try:
        peer = real.t.connect(h.meta, timeout=5)
        plan = scattered_plan(4096, 32, h.sizes[0], real.dst.nbytes, seed=2)
        assert real.t.read(peer, plan).wait(10) is ReadState.DONE
        assert mismatches(plan, {0: real.dst}, {0: h.sizes[0]}) == []
    finally:
        real.close()


def test_a_reader_cut_inside_its_handshake_tries_once_more():
    """A flooded holder gives up its oldest handshakes, which may be a real reader's: the reader
    reconnects once within its connect bound instead of failing the read."""
    instance, secret = os.urandom(16), os.urandom(32)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    admitted = []

    def flooded_holder() -> None:
        first, _ = srv.accept()
        first.sendall(handshake.pack_challenge(os.urandom(32)))
        first.close()  # cut before the proof arrived
        c, _ = srv.accept()  # the retry
        handshake.admit(c, instance, secret, time.monotonic() + 5)
        admitted.append(c)

    th = threading.Thread(target=flooded_holder, daemon=True)
    th.start()
    meta = json.dumps({"kind": "tcp", "v": 2, "wire": wire.WIRE_VERSION, "host": "127.0.0.1", "port": port,
                       "instance": instance.hex(), "secret": secret.hex(),
                       "regions": [{"index": 0, "nbytes": SIZE, "device": "cpu"}]}).encode()
    t = TcpTransport(connections=1)
    try:
        t.connect(meta, timeout=5)
        th.join(5)
        assert len(admitted) == 1
    finally:
        t.close()
        for c in admitted:
            c.close()
        srv.close()
