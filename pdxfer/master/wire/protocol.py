"""pdxfer-master wire protocol: one length-prefixed binary frame per request and per reply.

Frame = 16-byte header + JSON document + binary blob::

    magic  b"PX"   2 bytes
    version        u8   (PROTOCOL_VERSION; a mismatch is refused with a clear error)
    op             u8   (request op; a reply carries op | REPLY_BIT, an error carries OP_ERROR)
    request id     u32  (echoed in the reply)
    json length    u32  (<= MAX_JSON_BYTES)
    blob length    u32  (<= MAX_BLOB_BYTES)

The JSON part carries small fields; the blob carries what is big and fixed-size on the hot path
(32-byte chunk keys, concatenated; block ids as little-endian uint32), so a 512-key lookup never
pays for JSON-encoding keys or block lists. Everything is big-endian in the header.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Literal, Sequence, overload

import orjson

from pdxfer.kv.keys import KEY_BYTES

MAGIC = b"PX"
# Wire versions. Peers of different versions refuse each other (ERR_VERSION), so bump this when a
# frame's layout or a field's meaning changes, and add a row saying what changed:
#
#   version  what changed
#   -------  ------------------------------------------------------------------------------------
#   1        First format: 16-byte header, JSON part + blob; ops register .. ping (1-9); keys as
#            32-byte blobs, block ids as little-endian uint32 with "per" (uniform) or "counts".
#            Also in 1, before any release: lookups carry "have" {node id: epoch} and replies send
#            a node's description only when the client lacks that epoch; unpublish replies list
#            keys the node never published as removed (the holder may reuse their blocks).
#   2        Issue 9 (fenced writers). Epochs are unique across master incarnations (random
#            per-incarnation prefix). Lock TTLs are capped by the master: the register reply
#            carries "max_lock_ttl", a lookup reply's "ttl" is the granted (capped) TTL.
#            heartbeat, deregister, publish, unpublish carry "epoch" (the registration they belong
#            to); a superseded one is refused with error "superseded". Publishes carry "seq" (per
#            node, increasing); op 10 "fence" {node_id, epoch, upto} and unpublish's optional
#            "fence" make the master refuse (error "fenced") every later publish with seq <= upto.
#            Op 11 "hello" {tok}: with a token configured, the first frame of every connection
#            (<= MAX_PREAUTH_BYTES; anything else is refused before its body is read); requests
#            no longer carry "tok".
#   3        Tensor parallelism: register (and the node descriptions in lookup replies) carry
#            "tp" (the engine's TP size), "kvh" (its total KV heads, 0 = not said) and "eps",
#            the endpoints of ranks 1 .. tp-1 ([{rank, meta (base64), layout, fp}]); the flat
#            fields (rank, blob / "meta", layout, fp) keep meaning rank 0. One node per engine.
#            Lookups carry "parties" (releases the lock waits for: one per reader TP rank; the
#            entries stay pinned until the last, or the deadline); release's "all": true gives
#            back every party's share (a lock nobody reads under).
#   4        Issue 16 (a holder the reader cannot read hid one it can). Lookups may carry "skip"
#            {node id: epoch} (registrations the reader cannot read; epoch 0: every registration
#            of the node, e.g. the reader's own) and "transport" (the reader's): the master chooses
#            no holder that is skipped or registered another transport. A version-3 reader, which
#            cannot say either, is refused rather than served holders it may not read.
#
#            Also in 4 (additions an older peer ignores or answers "unknown op"; no field changed
#            meaning): register and node descriptions may carry "serve_url", "ns" (namespace root,
#            hex), "ct" (chunk tokens) and "role"; op 12 "peek" (a lookup that locks nothing) and
#            op 13 "nodes" (the live registrations' descriptions); op 14 "status" (per live node: what
#            it holds, the locks pinning it, its lease; and the master's leadership), read-only.
PROTOCOL_VERSION = 4
HEADER = struct.Struct("!2sBBIII")
HEADER_BYTES = HEADER.size  # 16

MAX_JSON_BYTES = 1 << 20  # 1 MiB of small fields is far beyond any legitimate request
MAX_BLOB_BYTES = 16 << 20  # 16 MiB: 512k keys, or 4M block ids
MAX_KEYS_PER_REQUEST = 65536
MAX_BLOCKS_PER_CHUNK = 65536
MAX_ID_CHARS = 256  # node ids, reader names, lock ids
MAX_METADATA_BYTES = 1 << 20
# Before a connection has authenticated (hello with the token), nothing but a hello of at most
# this many bytes is read: a peer without the token never makes the master buffer a large body.
MAX_PREAUTH_BYTES = 4096  # a transport metadata blob (NIXL's is ~550 bytes)
_U32_MAX = 0xFFFFFFFF

REPLY_BIT = 0x80
OP_ERROR = 0xFF

# Request ops.
OP_REGISTER = 1
OP_HEARTBEAT = 2
OP_DEREGISTER = 3
OP_PUBLISH = 4
OP_LOOKUP = 5
OP_RELEASE = 6
OP_UNPUBLISH = 7
OP_STATS = 8
OP_PING = 9
OP_FENCE = 10
OP_HELLO = 11  # first frame of a connection to a master with a token: authenticates the connection
OP_PEEK = 12  # read-only lookup: what the fleet holds of some keys and where, nothing locked
OP_NODES = 13  # the live registrations' descriptions
OP_STATUS = 14  # read-only operator view: leadership, and per live node its holdings, locks, lease

OP_NAMES = {
    OP_REGISTER: "register",
    OP_HEARTBEAT: "heartbeat",
    OP_DEREGISTER: "deregister",
    OP_PUBLISH: "publish",
    OP_LOOKUP: "lookup_and_lock",
    OP_RELEASE: "release",
    OP_UNPUBLISH: "unpublish_if_unlocked",
    OP_STATS: "stats",
    OP_PING: "ping",
    OP_FENCE: "fence",
    OP_HELLO: "hello",
    OP_PEEK: "peek",
    OP_NODES: "nodes",
    OP_STATUS: "status",
}

# Error codes carried in an OP_ERROR reply's JSON ("err").
ERR_MALFORMED = "malformed"
ERR_OVERSIZED = "oversized"
ERR_VERSION = "version"
ERR_AUTH = "auth"
ERR_UNKNOWN_NODE = "unknown_node"
ERR_NOT_LEADER = "not_leader"
ERR_UNKNOWN_OP = "unknown_op"
ERR_SUPERSEDED = "superseded"  # the call names a registration that a newer one of the node replaced
ERR_FENCED = "fenced"  # a publish whose seq the holder had already fenced (given up on)
ERR_INTERNAL = "internal"


class ProtocolError(ValueError):
    """A frame or document that does not follow the protocol. ``code`` is one of the ERR_* codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Header:
    version: int
    op: int
    req_id: int
    json_len: int
    blob_len: int


def parse_header(data: bytes, max_json: int = MAX_JSON_BYTES, max_blob: int = MAX_BLOB_BYTES) -> Header:
    """Validate a 16-byte header; raises ProtocolError naming what is wrong."""
    if len(data) != HEADER_BYTES:
        raise ProtocolError(ERR_MALFORMED, f"header must be {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, op, req_id, json_len, blob_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ERR_MALFORMED, f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ERR_VERSION, f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    if json_len > max_json:
        raise ProtocolError(ERR_OVERSIZED, f"JSON part of {json_len} bytes exceeds the limit of {max_json}")
    if blob_len > max_blob:
        raise ProtocolError(ERR_OVERSIZED, f"blob of {blob_len} bytes exceeds the limit of {max_blob}")
    return Header(version, op, req_id, json_len, blob_len)


def encode_frame(op: int, req_id: int, doc: dict[str, Any], blob: bytes = b"") -> bytes:
    try:
        # orjson: the JSON part is encoded and parsed on every request and reply on both sides,
        # and the standard library's codec was a tenth of the master's time per lookup.
        body = orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"a field of this {OP_NAMES.get(op & ~REPLY_BIT, op)} frame cannot be sent as JSON: {exc}") from None
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, op, req_id & _U32_MAX, len(body), len(blob)) + body + blob


def decode_json(data: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(ERR_MALFORMED, f"JSON part does not parse: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(ERR_MALFORMED, f"JSON part must be an object, got {type(doc).__name__}")
    return doc


# ---- field helpers: every bad field gets an error naming the field -------------------------------


@overload
def get_str(doc: dict[str, Any], name: str, optional: Literal[False] = False) -> str: ...
@overload
def get_str(doc: dict[str, Any], name: str, optional: bool) -> str | None: ...


def get_str(doc: dict[str, Any], name: str, optional: bool = False) -> str | None:
    value = doc.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ProtocolError(ERR_MALFORMED, f"field {name!r} must be a non-empty string of <= {MAX_ID_CHARS} chars")
    return value


def get_int(doc: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ERR_MALFORMED, f"field {name!r} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


@overload
def get_float(doc: dict[str, Any], name: str, lo: float, hi: float, optional: Literal[False] = False) -> float: ...
@overload
def get_float(doc: dict[str, Any], name: str, lo: float, hi: float, optional: bool) -> float | None: ...


def get_float(doc: dict[str, Any], name: str, lo: float, hi: float, optional: bool = False) -> float | None:
    value = doc.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ProtocolError(ERR_MALFORMED, f"field {name!r} must be a number in [{lo}, {hi}], got {value!r:.40}")
    return float(value)


def split_keys(blob: bytes | memoryview, n: int) -> list[bytes]:
    """The first ``n`` 32-byte keys of ``blob``."""
    if n < 0 or n > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(ERR_OVERSIZED, f"{n} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    if len(blob) < n * KEY_BYTES:
        raise ProtocolError(ERR_MALFORMED, f"blob holds {len(blob)} bytes, too short for {n} keys of {KEY_BYTES}")
    return list(_keys_struct(n).unpack_from(blob))


@functools.lru_cache(maxsize=64)
def _keys_struct(n: int) -> struct.Struct:
    # One C-speed unpack of n 32-byte strings (a Python slice loop costs ~5x more per lookup).
    return struct.Struct(f"{KEY_BYTES}s" * n)


def join_keys(keys: Sequence[bytes]) -> bytes:
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(keys)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    try:
        lengths = set(map(len, keys))  # C-speed check; the hot path sends 512 keys per lookup
        joined = b"".join(keys)
    except TypeError:
        lengths = {-1}
    if lengths - {KEY_BYTES}:
        for i, k in enumerate(keys):
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise ValueError(f"key {i} must be {KEY_BYTES} bytes, got {k!r:.60}")
    return joined


def pack_u32(values: Sequence[int]) -> bytes:
    """Little-endian uint32 array; raises ValueError naming a value outside uint32."""
    try:
        arr = array("I", values)
    except (OverflowError, TypeError) as exc:
        bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _U32_MAX), None)
        raise ValueError(f"block id {bad!r} is not an integer in [0, {_U32_MAX}]") from exc
    if arr.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte 'I'
        arr = array("L", values)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_u32(data: bytes | memoryview) -> list[int]:
    return unpack_u32_array(data).tolist()


def unpack_u32_array(data: bytes | memoryview) -> array:
    """Little-endian uint32s as an ``array('I')`` (no Python int per value until asked)."""
    if len(data) % 4:
        raise ProtocolError(ERR_MALFORMED, f"uint32 array of {len(data)} bytes is not a multiple of 4")
    arr = array("I")
    if arr.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte 'I'
        arr = array("L")
    arr.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr


def parse_hostport(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming the text otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {text!r} is not host:port")
    return host.strip("[]"), int(port)
