"""The codecs of the ops about a connection and the master itself rather than the index: hello
(the token check), stats, ping and status.
"""

from __future__ import annotations

from typing import Any

from pdxfer.master.wire import protocol as P
from pdxfer.master.wire.ops_common import Request, get_bool, malformed

# ---- hello ----------------------------------------------------------------------------------------


def encode_hello(token: str | None) -> Request:
    return Request(P.OP_HELLO, {"tok": token} if token is not None else {}, b"")


def decode_hello(doc: dict[str, Any], blob: bytes | memoryview) -> str | None:
    """The token the peer presents (None: none); the service compares it."""
    tok = doc.get("tok")
    return tok if isinstance(tok, str) else None


def decode_hello_reply(doc: dict[str, Any], blob: bytes | memoryview) -> bool:
    return get_bool(doc, "ok")


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
    get_bool(doc, "leader")
    return doc


# ---- status (operator view) -----------------------------------------------------------------------


def encode_status() -> Request:
    return Request(P.OP_STATUS, {}, b"")


def decode_status_reply(doc: dict[str, Any], blob: bytes | memoryview) -> dict[str, Any]:
    if not isinstance(doc.get("master"), dict) or not isinstance(doc.get("nodes"), list):
        raise malformed("a status reply must carry 'master' (an object) and 'nodes' (a list)")
    return doc
