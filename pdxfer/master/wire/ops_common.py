"""The pieces every master op codec shares: the request triple, the bounds of common fields, and
the field checks that name the field that is wrong.

The per-op codecs (ops_nodes.py, ops_publish.py, ops_lookup.py, ops_service.py) build on these;
ops.py lists every op.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.master.wire import protocol as P

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


def malformed(message: str) -> P.ProtocolError:
    return P.ProtocolError(P.ERR_MALFORMED, message)


def exact_blob(blob: bytes | memoryview, expected: int) -> None:
    if len(blob) != expected:
        raise malformed(f"blob is {len(blob)} bytes, the fields announce {expected}")


def keys_of(doc: dict[str, Any], blob: bytes | memoryview, extra_bytes: int = 0) -> list[bytes]:
    """The ``n`` keys at the start of a blob that holds exactly them plus ``extra_bytes``."""
    n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
    exact_blob(blob, n * KEY_BYTES + extra_bytes)
    return P.split_keys(blob, n)


def get_bool(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name)
    if not isinstance(value, bool):
        raise malformed(f"field {name!r} must be true or false, got {value!r:.40}")
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
        raise malformed(f"field 'counts' must be {n} integers in [0, {P.MAX_BLOCKS_PER_CHUNK}]")
    return counts


# ---- node references ------------------------------------------------------------------------------
# Every call of a node after registration names the registration ("epoch" from the register reply):
# a registration superseded by a newer one of the same node id is refused (issue 9, hole 2).

MAX_EPOCH = 1 << 62
MAX_SEQ = 1 << 62


class NodeRef(NamedTuple):
    node_id: str
    epoch: int


def node_ref(doc: dict[str, Any]) -> NodeRef:
    return NodeRef(P.get_str(doc, "node_id"), P.get_int(doc, "epoch", 0, MAX_EPOCH))
