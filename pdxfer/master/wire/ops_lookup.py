"""The codecs of the ops a reader calls: lookup_and_lock, peek (a read-only lookup) and release.

The lookup and peek replies are assembled as JSON text, not as a dict: the holders' node
descriptions, encoded once at registration (ops_nodes.py), are spliced in.
"""

from __future__ import annotations

import itertools
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable

import orjson

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.kv.tiers import TIERS
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.ops_common import (
    MAX_EPOCH,
    MAX_SKIP,
    MAX_TP,
    MAX_TTL_S,
    MIN_LOCK_TTL_S,
    Request,
    get_block_counts,
    keys_of,
    malformed,
    put_block_counts,
)
from pdxfer.master.wire.ops_nodes import decode_heartbeat_reply, decode_node_description
from pdxfer.master.wire.records import NodeInfo


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
        raise malformed(f"field 'skip' must map at most {MAX_SKIP} node ids to epochs in [0, {MAX_EPOCH}]")
    return raw


def decode_lookup(doc: dict[str, Any], blob: bytes | memoryview) -> LookupRequest:
    keys = keys_of(doc, blob)
    reader = P.get_str(doc, "reader")
    ttl = P.get_float(doc, "ttl", MIN_LOCK_TTL_S, MAX_TTL_S)
    have = doc.get("have")
    parties = P.get_int(doc, "parties", 1, MAX_TP) if "parties" in doc else 1
    skip = _get_skip(doc)
    transport = P.get_str(doc, "transport", optional=True)
    tier = P.get_str(doc, "tier", optional=True)
    if tier is not None and tier not in TIERS:
        raise malformed(f"field 'tier' must be one of {', '.join(TIERS)}, got {tier[:32]!r}")
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
        raise malformed("field 'runs' must be a list of [node id, chunks]")
    covered = 0
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2 or not isinstance(run[0], str)
                or type(run[1]) is not int or run[1] < 1):
            raise malformed(f"field 'runs' holds {run!r:.60}, not [node id, chunks >= 1]")
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
        raise malformed(f"lookup reply inconsistent: {covered} holders, {len(blocks)} block ids, hit {hit}")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, dict) or not {run[0] for run in runs} <= raw_nodes.keys():
        raise malformed("field 'nodes' must describe every holder named in 'runs'")
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
    keys = keys_of(doc, blob)
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
        raise malformed(f"field 'prefix' must map node ids to leading chunk counts in [1, {hit}]")
    device = doc.get("device", {})
    if (not isinstance(device, dict)
            or not all(k in prefix and type(v) is int and 0 <= v < prefix[k] for k, v in device.items())):
        raise malformed("field 'device' must map nodes named in 'prefix' to fewer leading chunks than there")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, dict) or not prefix.keys() <= raw_nodes.keys():
        raise malformed("field 'nodes' must describe every node named in 'prefix'")
    return PeekReply(hit, prefix, {nid: decode_node_description(nid, d) for nid, d in raw_nodes.items()},
                     {nid: device.get(nid, n) for nid, n in prefix.items()})



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

