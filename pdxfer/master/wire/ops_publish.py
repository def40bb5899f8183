"""The codecs of the ops that change what a node publishes: publish (with its sequence number),
unpublish_if_unlocked and fence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.ops_common import (
    MAX_RETENTION_S,
    MAX_SEQ,
    NodeRef,
    Request,
    get_block_counts,
    keys_of,
    malformed,
    node_ref,
    put_block_counts,
)


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
    node_id, epoch = node_ref(doc)
    seq = P.get_int(doc, "seq", 1, MAX_SEQ)
    n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
    counts = get_block_counts(doc, n)
    keys = keys_of(doc, blob, 4 * sum(counts))
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
    return UnpublishRequest(node_ref(doc), keys_of(doc, blob), fence)


def encode_unpublish_reply(removed: list[int]) -> dict[str, Any]:
    return {"removed": removed}


def decode_unpublish_reply(doc: dict[str, Any], blob: bytes | memoryview, asked: int) -> list[int]:
    """Indices into the request's keys that the node no longer publishes."""
    removed = doc.get("removed")
    if not isinstance(removed, list) or not all(type(i) is int and 0 <= i < asked for i in removed):
        raise malformed(f"field 'removed' must be a list of key indices in [0, {asked})")
    return removed


# ---- fence ----------------------------------------------------------------------------------------


def encode_fence(node_id: str, epoch: int, upto: int) -> Request:
    return Request(P.OP_FENCE, {"node_id": node_id, "epoch": epoch, "upto": upto}, b"")


def decode_fence(doc: dict[str, Any], blob: bytes | memoryview) -> tuple[NodeRef, int]:
    return node_ref(doc), P.get_int(doc, "upto", 0, MAX_SEQ)


def encode_fence_reply(fence: int) -> dict[str, Any]:
    return {"fence": fence}


def decode_fence_reply(doc: dict[str, Any], blob: bytes | memoryview) -> int:
    """The node's fence now (>= what was asked: it never goes back)."""
    return P.get_int(doc, "fence", 0, MAX_SEQ)

