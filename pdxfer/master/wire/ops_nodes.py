"""The codecs of the ops that manage a node's registration: register (and the node descriptions
it yields), heartbeat, deregister, and nodes (the live registrations).

Node descriptions are encoded once, at registration, and spliced into every lookup or peek reply
that names the node (a real layout description is ~12 KB of JSON).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.ops_common import (
    MAX_KV_HEADS,
    MAX_RANK,
    MAX_TP,
    MAX_TTL_S,
    MIN_LEASE_TTL_S,
    MIN_LOCK_TTL_S,
    NodeRef,
    Request,
    get_bool,
    malformed,
    node_ref,
)
from pdxfer.master.wire.records import NodeInfo, RankEndpoint, Registration


# ---- register -------------------------------------------------------------------------------------


MAX_URL_CHARS = 2048
MAX_NAMESPACE_CHARS = 128  # hex of a 32-byte namespace root is 64
MAX_CHUNK_TOKENS = 1 << 20
ROLES = ("", "kv_producer", "kv_consumer", "kv_both")
_HEX = frozenset("0123456789abcdef")


class Serving(NamedTuple):
    """What a router needs about an engine (optional in register requests and node descriptions;
    absent fields mean "not announced", as from a registration that predates them)."""

    serve_url: str = ""
    namespace: str = ""
    chunk_tokens: int = 0
    role: str = ""


def _put_serving(doc: dict[str, Any], s: Serving) -> None:
    # Only what is announced: a registration without these fields is byte-for-byte as before.
    for name, value in zip(("serve_url", "ns", "ct", "role"), s):
        if value:
            doc[name] = value


def _get_serving(doc: dict[str, Any], node_id: str) -> Serving:
    url = doc.get("serve_url", "")
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS or (url and not url.startswith(("http://", "https://"))):
        raise malformed(f"field 'serve_url' of node {node_id!r} must be an http:// or https:// URL of "
                        f"<= {MAX_URL_CHARS} chars, got {url!r:.60}")
    ns = doc.get("ns", "")
    if not isinstance(ns, str) or len(ns) > MAX_NAMESPACE_CHARS or not _HEX.issuperset(ns):
        raise malformed(f"field 'ns' (namespace) of node {node_id!r} must be lowercase hex of "
                        f"<= {MAX_NAMESPACE_CHARS} chars, got {ns!r:.60}")
    ct = P.get_int(doc, "ct", 0, MAX_CHUNK_TOKENS) if "ct" in doc else 0
    role = doc.get("role", "")
    if role not in ROLES:
        raise malformed(f"field 'role' of node {node_id!r} must be one of {ROLES[1:]}, got {role!r:.40}")
    return Serving(url, ns, ct, role)


def serving_of(info: NodeInfo) -> Serving:
    return Serving(info.serve_url, info.namespace, int(info.chunk_tokens), info.role)


@dataclass(frozen=True)
class RegisterRequest:
    node_id: str
    rank: int
    transport: str
    layout: dict
    fingerprint: str
    ttl: float
    metadata: bytes
    tp_size: int = 1
    total_kv_heads: int = 0
    more_ranks: tuple[RankEndpoint, ...] = ()
    serving: Serving = Serving()


def _encode_endpoints(eps: Sequence[RankEndpoint]) -> list[dict[str, Any]]:
    return [{"rank": int(e.rank), "meta": base64.b64encode(bytes(e.transport_metadata)).decode(),
             "layout": e.layout, "fp": e.layout_fingerprint} for e in eps]


def _decode_tp(doc: dict[str, Any], node_id: str) -> tuple[int, int, tuple[RankEndpoint, ...]]:
    """(tp size, total KV heads, endpoints of ranks 1 .. tp-1); absent fields mean TP 1."""
    tp = P.get_int(doc, "tp", 1, MAX_TP) if "tp" in doc else 1
    kvh = P.get_int(doc, "kvh", 0, MAX_KV_HEADS) if "kvh" in doc else 0
    raw = doc.get("eps", [])
    if not isinstance(raw, list) or len(raw) != tp - 1:
        raise malformed(f"field 'eps' of node {node_id!r} must list the {tp - 1} endpoint(s) of ranks 1..{tp - 1}")
    eps = []
    total_meta = 0
    for want, e in enumerate(raw, start=1):
        if not isinstance(e, dict) or not isinstance(e.get("layout"), dict):
            raise malformed(f"endpoint {want} of node {node_id!r} must be an object with a 'layout' object")
        rank = P.get_int(e, "rank", 0, MAX_RANK)
        if rank != want:
            raise malformed(f"endpoints of node {node_id!r} must be ranks 1..{tp - 1} in order, got rank {rank} "
                            f"at position {want}")
        try:
            meta = base64.b64decode(e.get("meta"), validate=True)
        except (ValueError, TypeError):
            raise malformed(f"field 'meta' of node {node_id!r} rank {rank} must be base64 text") from None
        total_meta += len(meta)
        if total_meta > P.MAX_METADATA_BYTES:
            raise P.ProtocolError(P.ERR_OVERSIZED, f"transport metadata of node {node_id!r} exceeds "
                                  f"{P.MAX_METADATA_BYTES} bytes over its ranks")
        eps.append(RankEndpoint(rank, meta, e["layout"], P.get_str(e, "fp")))
    return tp, kvh, tuple(eps)


def encode_register(info: NodeInfo, lease_ttl_s: float) -> Request:
    doc = {
        "node_id": info.node_id, "rank": int(info.rank), "transport": info.transport,
        "layout": info.layout, "fp": info.layout_fingerprint, "ttl": float(lease_ttl_s),
        "tp": int(info.tp_size), "kvh": int(info.total_kv_heads), "eps": _encode_endpoints(info.more_ranks),
    }
    _put_serving(doc, serving_of(info))
    return Request(P.OP_REGISTER, doc, bytes(info.transport_metadata))


def decode_register(doc: dict[str, Any], blob: bytes | memoryview) -> RegisterRequest:
    node_id = P.get_str(doc, "node_id")
    rank = P.get_int(doc, "rank", 0, MAX_RANK)
    transport = P.get_str(doc, "transport")
    fp = P.get_str(doc, "fp")
    layout = doc.get("layout")
    if not isinstance(layout, dict):
        raise malformed("field 'layout' must be an object")
    ttl = P.get_float(doc, "ttl", MIN_LEASE_TTL_S, MAX_TTL_S)
    if len(blob) > P.MAX_METADATA_BYTES:
        raise P.ProtocolError(P.ERR_OVERSIZED, f"transport metadata of {len(blob)} bytes exceeds {P.MAX_METADATA_BYTES}")
    tp, kvh, eps = _decode_tp(doc, node_id)
    serving = _get_serving(doc, node_id)
    return RegisterRequest(node_id, rank, transport, layout, fp, ttl, bytes(blob), tp, kvh, eps, serving)


def encode_register_reply(epoch: int, ttl: float, max_lock_ttl: float) -> dict[str, Any]:
    return {"ok": True, "epoch": epoch, "ttl": ttl, "max_lock_ttl": max_lock_ttl}


def decode_register_reply(doc: dict[str, Any], blob: bytes | memoryview, node_id: str) -> Registration:
    """The registration: its epoch, lease TTL and the master's lock TTL cap."""
    return Registration(node_id, P.get_int(doc, "epoch", 0, 1 << 62), P.get_float(doc, "ttl", 0.0, MAX_TTL_S),
                        P.get_float(doc, "max_lock_ttl", MIN_LOCK_TTL_S, MAX_TTL_S))


def encode_node_description(req: RegisterRequest, epoch: int) -> str:
    """The JSON object a lookup reply carries for this registration (encoded once, spliced often)."""
    d = {
        "node_id": req.node_id, "rank": req.rank, "transport": req.transport,
        "meta": base64.b64encode(req.metadata).decode(), "layout": req.layout, "fp": req.fingerprint,
        "epoch": epoch, "tp": req.tp_size, "kvh": req.total_kv_heads, "eps": _encode_endpoints(req.more_ranks),
    }
    _put_serving(d, req.serving)
    return json.dumps(d, separators=(",", ":"))


def decode_node_description(node_id: str, d: Any) -> tuple[int, NodeInfo | None]:
    """(epoch, description); the description is None when the master sent the epoch only."""
    if not isinstance(d, dict):
        raise malformed(f"node {node_id!r} in a lookup reply must be an object")
    epoch = P.get_int(d, "epoch", 0, 1 << 62)
    if "meta" not in d:
        return epoch, None
    layout = d.get("layout")
    if not isinstance(layout, dict):
        raise malformed(f"field 'layout' of node {node_id!r} must be an object")
    try:
        meta = base64.b64decode(d["meta"], validate=True)
    except (ValueError, TypeError):
        raise malformed(f"field 'meta' of node {node_id!r} must be base64 text") from None
    tp, kvh, eps = _decode_tp(d, node_id)
    info = NodeInfo(node_id, P.get_int(d, "rank", 0, MAX_RANK), P.get_str(d, "transport"), meta, layout,
                    P.get_str(d, "fp"), tp, kvh, eps, *_get_serving(d, node_id))
    return epoch, info



# ---- heartbeat, deregister ------------------------------------------------------------------------
# Every call of a node after registration names the registration (ops_common.py, node references).


def encode_heartbeat(node_id: str, epoch: int) -> Request:
    return Request(P.OP_HEARTBEAT, {"node_id": node_id, "epoch": epoch}, b"")


def decode_heartbeat(doc: dict[str, Any], blob: bytes | memoryview) -> NodeRef:
    return node_ref(doc)


def encode_heartbeat_reply(lease_left_s: float | None) -> dict[str, Any]:
    return {"ok": lease_left_s is not None, "ttl": lease_left_s}


def decode_heartbeat_reply(doc: dict[str, Any], blob: bytes | memoryview) -> bool:
    """False: the master does not know the node (any more)."""
    return get_bool(doc, "ok")


def encode_deregister(node_id: str, epoch: int) -> Request:
    return Request(P.OP_DEREGISTER, {"node_id": node_id, "epoch": epoch}, b"")


decode_deregister = decode_heartbeat  # the same fields


def encode_deregister_reply(known: bool) -> dict[str, Any]:
    return {"ok": known}


decode_deregister_reply = decode_heartbeat_reply  # {"ok": bool}


# ---- nodes (live registrations) -------------------------------------------------------------------


def encode_nodes() -> Request:
    return Request(P.OP_NODES, {}, b"")


def encode_nodes_reply(descriptions: Iterable[str]) -> bytes:
    """The reply's JSON part: the pre-encoded description of each live registration."""
    return ('{"nodes":[' + ",".join(descriptions) + "]}").encode()


def decode_nodes_reply(doc: dict[str, Any], blob: bytes | memoryview) -> list[tuple[int, NodeInfo]]:
    """(epoch, description) of every live registration."""
    raw = doc.get("nodes")
    if not isinstance(raw, list):
        raise malformed("field 'nodes' must be a list of node descriptions")
    out = []
    for d in raw:
        nid = d.get("node_id") if isinstance(d, dict) else None
        if not isinstance(nid, str) or not nid:
            raise malformed(f"a node description in a nodes reply lacks its 'node_id': {d!r:.60}")
        epoch, info = decode_node_description(nid, d)
        if info is None:
            raise malformed(f"node {nid!r} in a nodes reply has no description")
        out.append((epoch, info))
    return out

