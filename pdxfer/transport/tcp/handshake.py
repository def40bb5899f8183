"""The TCP transport's handshake: a reader proves it holds the holder's secret before any byte.

The secret (32 random bytes) travels only inside the holder's metadata, which the master hands
to authenticated clients; it changes with every memory registration. The holder speaks first,
so a reader never sends anything a holder could replay:

  challenge  holder -> reader   MAGIC_CHALLENGE u32 | version u16 | pad u16 | holder_nonce 32B | crc u32
  proof      reader -> holder   MAGIC_PROOF u32 | version u16 | pad u16 | reader_nonce 32B | mac 32B | crc u32
  verdict    holder -> reader   MAGIC_VERDICT u32 | version u16 | status u16 | mac 32B | crc u32

The reader's mac is HMAC-SHA256(secret, "pdxfer-tcp reader" | instance | holder_nonce |
reader_nonce); the holder compares it in constant time. On success the verdict's mac is the same
HMAC under "pdxfer-tcp holder", so the reader knows it reached the incarnation its metadata names
(the instance id is part of both macs and never sent). A failed proof of any kind (wrong secret,
stale metadata, a corrupt or garbage frame) gets one verdict, ``wire.ERR_AUTH`` with a zero mac,
then the connection closes: an unauthenticated peer learns a random nonce and nothing else. A
proof of another wire version gets ``wire.ERR_VERSION`` (its version field is the holder's).
The whole exchange must finish within the holder's hello deadline, counted from accept.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Callable

from pdxfer.transport.base import PeerDied, PeerUnreachable, TransferTimeout
from pdxfer.transport.tcp import wire

SECRET_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32

MAGIC_CHALLENGE = 0x50445843  # "PDXC"
MAGIC_PROOF = 0x50445850  # "PDXP"
MAGIC_VERDICT = 0x50445856  # "PDXV"

_PREFIX = struct.Struct("<IHH")  # magic, version, pad/status: the part every version keeps
_CHALLENGE = struct.Struct(f"<IHH{NONCE_BYTES}s")
_PROOF = struct.Struct(f"<IHH{NONCE_BYTES}s{MAC_BYTES}s")
_VERDICT = struct.Struct(f"<IHH{MAC_BYTES}s")
CHALLENGE_SIZE = _CHALLENGE.size + 4
PROOF_SIZE = _PROOF.size + 4
VERDICT_SIZE = _VERDICT.size + 4

_READER_LABEL = b"pdxfer-tcp reader"
_HOLDER_LABEL = b"pdxfer-tcp holder"


class WrongProof(PeerDied):
    """Holder side: the reader's proof was garbage or did not prove the secret."""


class AuthRefused(PeerDied):
    """The holder refused this reader's proof: its metadata is stale or carries a wrong secret."""


class VersionMismatch(PeerUnreachable):
    """Holder and reader speak different TCP wire versions."""


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def mac(secret: bytes, label: bytes, instance: bytes, holder_nonce: bytes, reader_nonce: bytes) -> bytes:
    return hmac.new(secret, label + instance + holder_nonce + reader_nonce, hashlib.sha256).digest()


def pack_challenge(nonce: bytes) -> bytes:
    return wire._seal(_CHALLENGE.pack(MAGIC_CHALLENGE, wire.WIRE_VERSION, 0, nonce))


def pack_proof(reader_nonce: bytes, proof_mac: bytes, version: int = wire.WIRE_VERSION) -> bytes:
    return wire._seal(_PROOF.pack(MAGIC_PROOF, version, 0, reader_nonce, proof_mac))


def pack_verdict(status: int, verdict_mac: bytes = bytes(MAC_BYTES)) -> bytes:
    return wire._seal(_VERDICT.pack(MAGIC_VERDICT, wire.WIRE_VERSION, status, verdict_mac))


def _version_error(side: str, version: int) -> VersionMismatch:
    return VersionMismatch(f"the {side} speaks TCP wire version {version}, this side speaks "
                           f"{wire.WIRE_VERSION}: run the same pdxfer version on holder and reader")


def _check_prefix(frame: bytes, magic: int, what: str, side: str) -> int:
    """The third header field of ``frame`` once magic and version are right; a different version
    is a :class:`VersionMismatch` (checked before the CRC: another version may seal differently)."""
    got_magic, version, third = _PREFIX.unpack_from(frame)
    if got_magic != magic:
        raise wire.CorruptFrame(f"{what}: magic {got_magic:#x}, want {magic:#x}")
    if version != wire.WIRE_VERSION:
        raise _version_error(side, version)
    return third


def recv_by(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Exactly ``n`` bytes before ``deadline`` (monotonic): a total bound, so a peer trickling a
    byte at a time cannot stretch it the way a per-receive timeout would let it."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what}: {got} of {n} bytes before the deadline")
        sec = int(left)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", sec, max(1, int((left - sec) * 1e6))))
        try:
            k = sock.recv_into(view[got:], n - got)
        except (BlockingIOError, socket.timeout):
            continue  # the kernel timeout ran out: the loop re-checks the deadline
        if k == 0:
            raise PeerDied(f"connection closed during {what} ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def admit(sock: socket.socket, instance: bytes, secret: bytes, deadline: float,
          on_proven: Callable[[], bool] | None = None) -> None:
    """Holder side: challenge, check the proof, send the verdict. Returns only for a reader that
    proved the secret; raises (after the refusal verdict, where one is due) otherwise.
    ``on_proven``: called once the proof checked out and before the verdict goes, so the
    holder counts the reader as authenticated before the reader can know it is; False (the
    connection was cut meanwhile) refuses it."""
    nonce = os.urandom(NONCE_BYTES)
    sock.sendall(pack_challenge(nonce))
    head = recv_by(sock, _PREFIX.size, deadline, "proof")
    try:
        _check_prefix(head, MAGIC_PROOF, "proof", "reader")
    except VersionMismatch:
        sock.sendall(pack_verdict(wire.ERR_VERSION))
        raise
    except wire.CorruptFrame as exc:
        sock.sendall(pack_verdict(wire.ERR_AUTH))
        raise WrongProof(f"the reader's proof is no pdxfer frame: {exc}") from None
    frame = head + recv_by(sock, PROOF_SIZE - _PREFIX.size, deadline, "proof")
    ok = False
    reader_nonce = b""
    try:
        _m, _v, _pad, reader_nonce, got = _PROOF.unpack(wire._unseal(frame, "proof"))
        ok = hmac.compare_digest(got, mac(secret, _READER_LABEL, instance, nonce, reader_nonce))
    except wire.CorruptFrame:
        pass
    if not ok:
        sock.sendall(pack_verdict(wire.ERR_AUTH))
        raise WrongProof("reader did not prove the holder's secret")
    if on_proven is not None and not on_proven():
        raise AuthRefused("the connection was cut while the reader proved the secret")
    sock.sendall(pack_verdict(wire.OK, mac(secret, _HOLDER_LABEL, instance, nonce, reader_nonce)))


def prove(sock: socket.socket, instance: bytes, secret: bytes, deadline: float, peer: str) -> None:
    """Reader side: answer the holder's challenge and check its verdict (``peer`` names the
    holder in errors). Returns once both sides proved the secret."""
    frame = recv_by(sock, CHALLENGE_SIZE, deadline, "holder challenge")
    _check_prefix(frame, MAGIC_CHALLENGE, "challenge", "holder")
    _m, _v, _pad, nonce = _CHALLENGE.unpack(wire._unseal(frame, "challenge"))
    mine = os.urandom(NONCE_BYTES)
    sock.sendall(pack_proof(mine, mac(secret, _READER_LABEL, instance, nonce, mine)))
    frame = recv_by(sock, VERDICT_SIZE, deadline, "holder verdict")
    status = _check_prefix(frame, MAGIC_VERDICT, "verdict", "holder")
    _m, _v, status, theirs = _VERDICT.unpack(wire._unseal(frame, "verdict"))
    if status == wire.ERR_VERSION:
        raise VersionMismatch(f"holder {peer} refused this reader's TCP wire version {wire.WIRE_VERSION}: "
                              f"run the same pdxfer version on holder and reader")
    if status != wire.OK:
        raise AuthRefused(f"holder {peer} refused this reader's proof: the metadata is stale (the holder "
                          f"restarted or registered its memory again) or its secret is wrong; look the "
                          f"holder up again for fresh metadata")
    if not hmac.compare_digest(theirs, mac(secret, _HOLDER_LABEL, instance, nonce, mine)):
        raise AuthRefused(f"the process at {peer} accepted the proof but could not prove the secret "
                          f"itself: it is not the holder this metadata names")
