"""One request codec and one reply codec per master op, used by the client and by the service.

``encode_<op>(...)`` builds a request (op, JSON document, blob); ``decode_<op>(doc, blob)`` checks
and parses it on the service side. ``encode_<op>_reply(...)`` builds the reply document and
``decode_<op>_reply(doc, blob, ...)`` checks and parses it on the client side. Every check names the
field that is wrong (a ``ProtocolError`` with code ``malformed`` or ``oversized``), so a field's
name, type and bounds are written down once, here.

The lookup reply is assembled as JSON text, not as a dict: node descriptions are encoded once, at
registration, and spliced in (a real layout description is ~12 KB of JSON).
"""

from __future__ import annotations

import base64
import itertools
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import orjson

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.records import NodeInfo, RankEndpoint, Registration
from pdxfer.kv.tiers import TIERS

MAX_TTL_S = 3600.0  # node leases and reader locks
MAX_RETENTION_S = 30 * 24 * 3600.0
MAX_RANK = 1 << 20
MAX_TP = 1024  # ranks of one engine (vLLM's largest TP groups are far below)
MAX_KV_HEADS = 1 << 16
MIN_LEASE_TTL_S = 0.1
MIN_LOCK_TTL_S = 0.001
MAX_SKIP = 4096  # registrations one lookup may rule out (a reader keeps far fewer)


class Request(NamedTuple):
    op: int
    doc: dict[str, Any]
    blob: bytes


def _malformed(message: str) -> P.ProtocolError:
    return P.ProtocolError(P.ERR_MALFORMED, message)


def _exact_blob(blob: bytes | memoryview, expected: int) -> None:
    if len(blob) != expected:
        raise _malformed(f"blob is {len(blob)} bytes, the fields announce {expected}")


def _keys_of(doc: dict[str, Any], blob: bytes | memoryview, extra_bytes: int = 0) -> list[bytes]:
    """The ``n`` keys at the start of a blob that holds exactly them plus ``extra_bytes``."""
    n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
    _exact_blob(blob, n * KEY_BYTES + extra_bytes)
    return P.split_keys(blob, n)


def _get_bool(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name)
    if not isinstance(value, bool):
        raise _malformed(f"field {name!r} must be true or false, got {value!r:.40}")
    return value


# ---- block counts: uniform ("per") or one per chunk ("counts"), in publishes and lookup replies --


def put_block_counts(doc: dict[str, Any], counts: Sequence[int]) -> None:
    if counts and counts.count(counts[0]) == len(counts):  # C-speed uniformity check
        doc["per"] = counts[0]
    else:
        doc["counts"] = list(counts)


def get_block_counts(doc: dict[str, Any], n: int) -> list[int]:
    if "per" in doc:
        return [P.get_int(doc, "per", 0, P.MAX_BLOCKS_PER_CHUNK)] * n
    counts = doc.get("counts")
    if (
        not isinstance(counts, list)
        or len(counts) != n
        or not all(type(c) is int and 0 <= c <= P.MAX_BLOCKS_PER_CHUNK for c in counts)
    ):
        raise _malformed(f"field 'counts' must be {n} integers in [0, {P.MAX_BLOCKS_PER_CHUNK}]")
    return counts


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
        raise _malformed(f"field 'serve_url' of node {node_id!r} must be an http:// or https:// URL of "
                         f"<= {MAX_URL_CHARS} chars, got {url!r:.60}")
    ns = doc.get("ns", "")
    if not isinstance(ns, str) or len(ns) > MAX_NAMESPACE_CHARS or not _HEX.issuperset(ns):
        raise _malformed(f"field 'ns' (namespace) of node {node_id!r} must be lowercase hex of "
                         f"<= {MAX_NAMESPACE_CHARS} chars, got {ns!r:.60}")
    ct = P.get_int(doc, "ct", 0, MAX_CHUNK_TOKENS) if "ct" in doc else 0
    role = doc.get("role", "")
    if role not in ROLES:
        raise _malformed(f"field 'role' of node {node_id!r} must be one of {ROLES[1:]}, got {role!r:.40}")
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
        raise _malformed(f"field 'eps' of node {node_id!r} must list the {tp - 1} endpoint(s) of ranks 1..{tp - 1}")
    eps = []
    total_meta = 0
    for want, e in enumerate(raw, start=1):
        if not isinstance(e, dict) or not isinstance(e.get("layout"), dict):
            raise _malformed(f"endpoint {want} of node {node_id!r} must be an object with a 'layout' object")
        rank = P.get_int(e, "rank", 0, MAX_RANK)
        if rank != want:
            raise _malformed(f"endpoints of node {node_id!r} must be ranks 1..{tp - 1} in order, got rank {rank} "
                             f"at position {want}")
        try:
            meta = base64.b64decode(e.get("meta"), validate=True)
        except (ValueError, TypeError):
            raise _malformed(f"field 'meta' of node {node_id!r} rank {rank} must be base64 text") from None
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
        raise _malformed("field 'layout' must be an object")
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
        raise _malformed(f"node {node_id!r} in a lookup reply must be an object")
    epoch = P.get_int(d, "epoch", 0, 1 << 62)
    if "meta" not in d:
        return epoch, None
    layout = d.get("layout")
    if not isinstance(layout, dict):
        raise _malformed(f"field 'layout' of node {node_id!r} must be an object")
    try:
        meta = base64.b64decode(d["meta"], validate=True)
    except (ValueError, TypeError):
        raise _malformed(f"field 'meta' of node {node_id!r} must be base64 text") from None
    tp, kvh, eps = _decode_tp(d, node_id)
    info = NodeInfo(node_id, P.get_int(d, "rank", 0, MAX_RANK), P.get_str(d, "transport"), meta, layout,
                    P.get_str(d, "fp"), tp, kvh, eps, *_get_serving(d, node_id))
    return epoch, info


# ---- heartbeat, deregister ------------------------------------------------------------------------
# Every call of a node after registration names the registration ("epoch" from the register reply):
# a registration superseded by a newer one of the same node id is refused (issue 9, hole 2).

MAX_EPOCH = 1 << 62
MAX_SEQ = 1 << 62


class NodeRef(NamedTuple):
    node_id: str
    epoch: int


def _node_ref(doc: dict[str, Any]) -> NodeRef:
    return NodeRef(P.get_str(doc, "node_id"), P.get_int(doc, "epoch", 0, MAX_EPOCH))


def encode_heartbeat(node_id: str, epoch: int) -> Request:
    return Request(P.OP_HEARTBEAT, {"node_id": node_id, "epoch": epoch}, b"")


def decode_heartbeat(doc: dict[str, Any], blob: bytes | memoryview) -> NodeRef:
    return _node_ref(doc)


def encode_heartbeat_reply(lease_left_s: float | None) -> dict[str, Any]:
    return {"ok": lease_left_s is not None, "ttl": lease_left_s}


def decode_heartbeat_reply(doc: dict[str, Any], blob: bytes | memoryview) -> bool:
    """False: the master does not know the node (any more)."""
    return _get_bool(doc, "ok")


def encode_deregister(node_id: str, epoch: int) -> Request:
    return Request(P.OP_DEREGISTER, {"node_id": node_id, "epoch": epoch}, b"")


decode_deregister = decode_heartbeat  # the same fields


def encode_deregister_reply(known: bool) -> dict[str, Any]:
    return {"ok": known}


decode_deregister_reply = decode_heartbeat_reply  # {"ok": bool}


# ---- publish --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishRequest:
    node_id: str
    epoch: int
    items: list[tuple[bytes, bytes]]  # (key, little-endian uint32 block ids)
    retention_s: float | None
    seq: int  # per node, increasing; refused at or below the node's fence


def encode_publish(node_id: str, entries: Sequence[tuple[bytes, Sequence[int]]],
                   retention_s: float | None, epoch: int, seq: int) -> Request:
    counts = [len(b) for _, b in entries]
    blocks = P.pack_u32([int(x) for _, b in entries for x in b])
    doc: dict[str, Any] = {"node_id": node_id, "epoch": epoch, "seq": seq, "n": len(entries)}
    put_block_counts(doc, counts)
    if retention_s is not None:
        doc["ret"] = float(retention_s)
    return Request(P.OP_PUBLISH, doc, P.join_keys([k for k, _ in entries]) + blocks)


def decode_publish(doc: dict[str, Any], blob: bytes | memoryview) -> PublishRequest:
    node_id, epoch = _node_ref(doc)
    seq = P.get_int(doc, "seq", 1, MAX_SEQ)
    n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
    counts = get_block_counts(doc, n)
    keys = _keys_of(doc, blob, 4 * sum(counts))
    blocks = bytes(blob[n * KEY_BYTES :])
    offs = itertools.accumulate((4 * c for c in counts), initial=0)
    start = next(offs)
    items = []
    for key, end in zip(keys, offs):
        items.append((key, blocks[start:end]))
        start = end
    retention = P.get_float(doc, "ret", 0.0, MAX_RETENTION_S, optional=True)
    return PublishRequest(node_id, epoch, items, retention, seq)


def encode_publish_reply(accepted: int) -> dict[str, Any]:
    return {"accepted": accepted}


def decode_publish_reply(doc: dict[str, Any], blob: bytes | memoryview, asked: int) -> int:
    return P.get_int(doc, "accepted", 0, asked)


# ---- lookup_and_lock ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupRequest:
    keys: list[bytes]
    reader: str
    ttl: float
    have: dict[str, int]  # node id -> epoch whose description the client already holds
    parties: int = 1  # releases the lock expects (TP ranks reading under it)
    # Registrations the reader cannot read (node id -> epoch; 0: every registration of the node)
    # and the reader's transport (None: any): the master chooses no such holder.
    skip: dict[str, int] = field(default_factory=dict)
    transport: str | None = None
    prefer_tier: str | None = None  # the tier the reader measured faster (pdxfer.kv.tiers)


def encode_lookup(joined_keys: bytes, reader: str, lock_ttl_s: float, have: dict[str, int],
                  parties: int = 1, skip: dict[str, int] | None = None,
                  transport: str | None = None, prefer_tier: str | None = None) -> Request:
    """``joined_keys``: ``protocol.join_keys(keys)`` (the caller may retry with the same bytes)."""
    doc: dict[str, Any] = {"n": len(joined_keys) // KEY_BYTES, "reader": reader, "ttl": float(lock_ttl_s),
                           "have": have, "parties": int(parties)}
    if skip:
        doc["skip"] = {str(k): int(v) for k, v in skip.items()}
    if transport is not None:
        doc["transport"] = transport
    if prefer_tier is not None:
        doc["tier"] = prefer_tier
    return Request(P.OP_LOOKUP, doc, joined_keys)


def _get_skip(doc: dict[str, Any]) -> dict[str, int]:
    raw = doc.get("skip", {})
    if (not isinstance(raw, dict) or len(raw) > MAX_SKIP
            or not all(isinstance(k, str) and 0 < len(k) <= P.MAX_ID_CHARS and type(v) is int
                       and 0 <= v <= MAX_EPOCH for k, v in raw.items())):
        raise _malformed(f"field 'skip' must map at most {MAX_SKIP} node ids to epochs in [0, {MAX_EPOCH}]")
    return raw


def decode_lookup(doc: dict[str, Any], blob: bytes | memoryview) -> LookupRequest:
    keys = _keys_of(doc, blob)
    reader = P.get_str(doc, "reader")
    ttl = P.get_float(doc, "ttl", MIN_LOCK_TTL_S, MAX_TTL_S)
    have = doc.get("have")
    parties = P.get_int(doc, "parties", 1, MAX_TP) if "parties" in doc else 1
    skip = _get_skip(doc)
    transport = P.get_str(doc, "transport", optional=True)
    tier = P.get_str(doc, "tier", optional=True)
    if tier is not None and tier not in TIERS:
        raise _malformed(f"field 'tier' must be one of {', '.join(TIERS)}, got {tier[:32]!r}")
    # "have" only saves bytes: anything unusable means "send every description".
    return LookupRequest(keys, reader, ttl, have if isinstance(have, dict) else {}, parties, skip, transport, tier)


def encode_lookup_reply(lock_id: str | None, hit: int, ttl: float, runs: list[tuple[str, int]],
                        counts: list[int], nodes: Iterable[tuple[str, int, str]],
                        have: dict[str, int]) -> bytes:
    """The reply's JSON part. ``nodes``: (node id, epoch, pre-encoded description) of every holder
    in ``runs``; one the client has at that epoch is sent as its epoch only."""
    head: dict[str, Any] = {"lock": lock_id, "hit": hit, "ttl": ttl, "runs": runs}
    put_block_counts(head, counts)
    parts = _splice_nodes(nodes, have)
    return orjson.dumps(head)[:-1] + b',"nodes":{' + parts.encode() + b"}}"


@dataclass(frozen=True)
class LookupReply:
    """A decoded lookup reply. Checked in full when decoded; the per-chunk lists (``holders``,
    ``block_lists``) are built only when asked for, from the runs and the raw block id array (a
    caller that uses only the hit count and lock never pays for 2 lists per chunk)."""

    lock_id: str | None
    hit: int
    ttl: float
    runs: list[tuple[str, int]]  # (node id, chunks) in chunk order, covering the hit
    blocks: array  # every hit chunk's block ids, concatenated (uint32)
    per: int  # block ids per chunk when uniform, else 0 and ``counts`` says
    counts: list[int] | None
    nodes: dict[str, tuple[int, NodeInfo | None]]  # node id -> (epoch, description or None)

    @property
    def holders(self) -> list[str]:
        """Node id per hit chunk."""
        out: list[str] = []
        for nid, n in self.runs:
            out += [nid] * n
        return out

    @property
    def block_lists(self) -> list[list[int]]:
        """Block ids per hit chunk."""
        ids = self.blocks.tolist()
        if self.per:  # uniform chunks (the usual case): split in C, not a Python slice per chunk
            return list(map(list, zip(*[iter(ids)] * self.per)))
        offs = list(itertools.accumulate(self.counts or (), initial=0))
        return [ids[offs[j] : offs[j + 1]] for j in range(self.hit)]


def decode_lookup_reply(doc: dict[str, Any], blob: bytes | memoryview, asked: int) -> LookupReply:
    hit = P.get_int(doc, "hit", 0, asked)
    ttl = P.get_float(doc, "ttl", 0.0, MAX_TTL_S)
    if hit == 0:
        return LookupReply(None, 0, ttl, [], array("I"), 0, None, {})
    lock_id = P.get_str(doc, "lock")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise _malformed("field 'runs' must be a list of [node id, chunks]")
    covered = 0
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2 or not isinstance(run[0], str)
                or type(run[1]) is not int or run[1] < 1):
            raise _malformed(f"field 'runs' holds {run!r:.60}, not [node id, chunks >= 1]")
        covered += run[1]
    per = doc.get("per")
    if type(per) is int and per > 0 and per <= P.MAX_BLOCKS_PER_CHUNK:
        counts = None
        total = per * hit
    else:
        per = 0
        counts = get_block_counts(doc, hit)
        total = sum(counts)
    blocks = P.unpack_u32_array(blob)
    if covered != hit or total != len(blocks):
        raise _malformed(f"lookup reply inconsistent: {covered} holders, {len(blocks)} block ids, hit {hit}")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, dict) or not {run[0] for run in runs} <= raw_nodes.keys():
        raise _malformed("field 'nodes' must describe every holder named in 'runs'")
    nodes = {nid: decode_node_description(nid, d) for nid, d in raw_nodes.items()}
    return LookupReply(lock_id, hit, ttl, [(r[0], r[1]) for r in runs], blocks, per, counts, nodes)


# ---- peek (read-only lookup) ---------------------------------------------------------------------


@dataclass(frozen=True)
class PeekRequest:
    keys: list[bytes]
    have: dict[str, int]  # as in lookups: descriptions the client holds are sent as epochs only
    skip: dict[str, int] = field(default_factory=dict)
    transport: str | None = None


def encode_peek(joined_keys: bytes, have: dict[str, int], skip: dict[str, int] | None = None,
                transport: str | None = None) -> Request:
    doc: dict[str, Any] = {"n": len(joined_keys) // KEY_BYTES, "have": have}
    if skip:
        doc["skip"] = {str(k): int(v) for k, v in skip.items()}
    if transport is not None:
        doc["transport"] = transport
    return Request(P.OP_PEEK, doc, joined_keys)


def decode_peek(doc: dict[str, Any], blob: bytes | memoryview) -> PeekRequest:
    keys = _keys_of(doc, blob)
    have = doc.get("have")
    return PeekRequest(keys, have if isinstance(have, dict) else {}, _get_skip(doc),
                       P.get_str(doc, "transport", optional=True))


def _splice_nodes(nodes: Iterable[tuple[str, int, str]], have: dict[str, int]) -> str:
    return ",".join(
        f'{json.dumps(nid)}:{{"epoch":{epoch}}}' if have.get(nid) == epoch else f"{json.dumps(nid)}:{info_json}"
        for nid, epoch, info_json in nodes
    )


def encode_peek_reply(hit: int, prefix_by_node: dict[str, int], nodes: Iterable[tuple[str, int, str]],
                      have: dict[str, int], device_prefix_by_node: dict[str, int] | None = None) -> bytes:
    """The reply's JSON part; ``nodes`` as in ``encode_lookup_reply`` (every node in the prefix map).
    ``device_prefix_by_node``: only nodes whose device tier holds fewer leading keys than their
    prefix (sent as "device"; absent when none)."""
    doc: dict[str, Any] = {"hit": hit, "prefix": prefix_by_node}
    if device_prefix_by_node:
        doc["device"] = device_prefix_by_node
    head = json.dumps(doc, separators=(",", ":"))
    return (head[:-1] + ',"nodes":{' + _splice_nodes(nodes, have) + "}}").encode()


@dataclass(frozen=True)
class PeekReply:
    hit: int
    prefix_by_node: dict[str, int]
    nodes: dict[str, tuple[int, NodeInfo | None]]  # node id -> (epoch, description or None)
    # node id -> leading keys in its device tier, for every node in prefix_by_node
    device_prefix_by_node: dict[str, int] = field(default_factory=dict)


def decode_peek_reply(doc: dict[str, Any], blob: bytes | memoryview, asked: int) -> PeekReply:
    hit = P.get_int(doc, "hit", 0, asked)
    prefix = doc.get("prefix")
    if (not isinstance(prefix, dict)
            or not all(isinstance(k, str) and type(v) is int and 0 < v <= hit for k, v in prefix.items())):
        raise _malformed(f"field 'prefix' must map node ids to leading chunk counts in [1, {hit}]")
    device = doc.get("device", {})
    if (not isinstance(device, dict)
            or not all(k in prefix and type(v) is int and 0 <= v < prefix[k] for k, v in device.items())):
        raise _malformed("field 'device' must map nodes named in 'prefix' to fewer leading chunks than there")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, dict) or not prefix.keys() <= raw_nodes.keys():
        raise _malformed("field 'nodes' must describe every node named in 'prefix'")
    return PeekReply(hit, prefix, {nid: decode_node_description(nid, d) for nid, d in raw_nodes.items()},
                     {nid: device.get(nid, n) for nid, n in prefix.items()})


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
        raise _malformed("field 'nodes' must be a list of node descriptions")
    out = []
    for d in raw:
        nid = d.get("node_id") if isinstance(d, dict) else None
        if not isinstance(nid, str) or not nid:
            raise _malformed(f"a node description in a nodes reply lacks its 'node_id': {d!r:.60}")
        epoch, info = decode_node_description(nid, d)
        if info is None:
            raise _malformed(f"node {nid!r} in a nodes reply has no description")
        out.append((epoch, info))
    return out


# ---- release --------------------------------------------------------------------------------------


def encode_release(lock_id: str, all_parties: bool = False) -> Request:
    doc: dict[str, Any] = {"lock": lock_id}
    if all_parties:
        doc["all"] = True
    return Request(P.OP_RELEASE, doc, b"")


def decode_release(doc: dict[str, Any], blob: bytes | memoryview) -> tuple[str, bool]:
    """(lock id, whether every party's share is released: a lock nobody reads under)."""
    return P.get_str(doc, "lock"), doc.get("all") is True


def encode_release_reply(valid: bool) -> dict[str, Any]:
    return {"ok": valid}


decode_release_reply = decode_heartbeat_reply  # {"ok": bool}: True only if the lock was still valid


# ---- unpublish_if_unlocked ------------------------------------------------------------------------


class UnpublishRequest(NamedTuple):
    node: NodeRef
    keys: list[bytes]
    fence: int | None  # first refuse every later publish with seq <= this


def encode_unpublish(node_id: str, keys: Sequence[bytes], epoch: int, fence: int | None = None) -> Request:
    doc: dict[str, Any] = {"node_id": node_id, "epoch": epoch, "n": len(keys)}
    if fence is not None:
        doc["fence"] = fence
    return Request(P.OP_UNPUBLISH, doc, P.join_keys(keys))


def decode_unpublish(doc: dict[str, Any], blob: bytes | memoryview) -> UnpublishRequest:
    fence = P.get_int(doc, "fence", 0, MAX_SEQ) if "fence" in doc else None
    return UnpublishRequest(_node_ref(doc), _keys_of(doc, blob), fence)


def encode_unpublish_reply(removed: list[int]) -> dict[str, Any]:
    return {"removed": removed}


def decode_unpublish_reply(doc: dict[str, Any], blob: bytes | memoryview, asked: int) -> list[int]:
    """Indices into the request's keys that the node no longer publishes."""
    removed = doc.get("removed")
    if not isinstance(removed, list) or not all(type(i) is int and 0 <= i < asked for i in removed):
        raise _malformed(f"field 'removed' must be a list of key indices in [0, {asked})")
    return removed


# ---- fence ----------------------------------------------------------------------------------------


def encode_fence(node_id: str, epoch: int, upto: int) -> Request:
    return Request(P.OP_FENCE, {"node_id": node_id, "epoch": epoch, "upto": upto}, b"")


def decode_fence(doc: dict[str, Any], blob: bytes | memoryview) -> tuple[NodeRef, int]:
    return _node_ref(doc), P.get_int(doc, "upto", 0, MAX_SEQ)


def encode_fence_reply(fence: int) -> dict[str, Any]:
    return {"fence": fence}


def decode_fence_reply(doc: dict[str, Any], blob: bytes | memoryview) -> int:
    """The node's fence now (>= what was asked: it never goes back)."""
    return P.get_int(doc, "fence", 0, MAX_SEQ)


# ---- hello ----------------------------------------------------------------------------------------


def encode_hello(token: str | None) -> Request:
    return Request(P.OP_HELLO, {"tok": token} if token is not None else {}, b"")


def decode_hello(doc: dict[str, Any], blob: bytes | memoryview) -> str | None:
    """The token the peer presents (None: none); the service compares it."""
    tok = doc.get("tok")
    return tok if isinstance(tok, str) else None


def decode_hello_reply(doc: dict[str, Any], blob: bytes | memoryview) -> bool:
    return _get_bool(doc, "ok")


# ---- stats, ping ----------------------------------------------------------------------------------


def encode_stats() -> Request:
    return Request(P.OP_STATS, {}, b"")


def decode_stats_reply(doc: dict[str, Any], blob: bytes | memoryview) -> dict[str, Any]:
    """Counters and status; their names are the service's (see service_stats.py), not checked here."""
    return doc


def encode_ping() -> Request:
    return Request(P.OP_PING, {}, b"")


def encode_ping_reply(leader: bool, leader_address: str | None) -> dict[str, Any]:
    return {"leader": leader, "leader_address": leader_address}


def decode_ping_reply(doc: dict[str, Any], blob: bytes | memoryview) -> dict[str, Any]:
    _get_bool(doc, "leader")
    return doc


# ---- status (operator view) -----------------------------------------------------------------------


def encode_status() -> Request:
    return Request(P.OP_STATUS, {}, b"")


def decode_status_reply(doc: dict[str, Any], blob: bytes | memoryview) -> dict[str, Any]:
    if not isinstance(doc.get("master"), dict) or not isinstance(doc.get("nodes"), list):
        raise _malformed("a status reply must carry 'master' (an object) and 'nodes' (a list)")
    return doc
