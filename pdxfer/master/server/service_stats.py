"""What the master reports about itself: the stats and status ops and ``GET /health`` (``GET /metrics``
is built from the same values in ``metrics_export.py``)."""

from __future__ import annotations

import base64
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdxfer.master.server.master_service import MasterService


def stats(svc: MasterService) -> dict[str, Any]:
    s = svc.index.snapshot()
    s["hit_tokens"] = s["hit_chunks"] * svc.chunk_tokens
    s["lookup_handler_s"] = round(svc.lookup_seconds, 6)
    s["auth_failures"] = svc.auth_failures
    s["bad_frames"] = svc.bad_frames
    s["connections"] = len(svc._conns)
    s["connections_refused"] = svc.connections_refused
    s["unproven_evicted"] = svc.unproven_evicted
    s["http_connections_cut"] = svc.http_connections_cut
    s["handshake_timeouts"] = svc.handshake_timeouts
    s["uptime_s"] = round(time.time() - svc.started, 3)
    s.update(svc.coord.status())
    return s


def health(svc: MasterService) -> tuple[bool, dict[str, Any]]:
    if not svc.coord.is_leader:
        status = "standby"
    elif svc.coord.degraded:
        status = "degraded"
    else:
        status = "ok"
    return True, {"status": status, **svc.coord.status()}


def _endpoint(meta_b64: str) -> str:
    """host:port of a transport whose metadata is JSON naming them (TCP); "" otherwise. Only
    these two fields are read: the metadata also carries the holder's transfer secret."""
    try:
        doc = json.loads(base64.b64decode(meta_b64))
    except (ValueError, TypeError):
        return ""
    if isinstance(doc, dict) and isinstance(doc.get("host"), str) and isinstance(doc.get("port"), int):
        return f"{doc['host']}:{doc['port']}"
    return ""


def _node_status(node: Any, now: float) -> dict[str, Any]:
    try:
        d = json.loads(node.info_json) if node.info_json else {}
    except ValueError:
        d = {}
    layout = d.get("layout") if isinstance(d.get("layout"), dict) else {}
    endpoints = [{"rank": d.get("rank", 0), "endpoint": _endpoint(d.get("meta", ""))}]
    endpoints += [{"rank": ep.get("rank"), "endpoint": _endpoint(ep.get("meta", ""))}
                  for ep in d.get("eps") or () if isinstance(ep, dict)]
    lease_left = node.expires_at - now
    return {
        "node_id": node.node_id,
        "epoch": node.epoch,
        "role": d.get("role", ""),
        "transport": node.transport or d.get("transport", ""),
        "serve_url": d.get("serve_url", ""),
        "endpoints": endpoints,
        "layout": {"block_size": layout.get("block_size"), "dtype": layout.get("dtype"),
                   "kv_heads": d.get("kvh", 0), "tp": d.get("tp", 1), "chunk_tokens": d.get("ct", 0),
                   "namespace": d.get("ns", ""), "fingerprint": d.get("fp", "")},
        "entries": len(node.entries),
        "blocks": node.held_blocks,
        "locks": len(node.locks),
        "lease_ttl_s": round(node.ttl, 3),
        "lease_left_s": round(lease_left, 3),
        # Every heartbeat (and the registration) sets the lease to ttl: its age is what has run off.
        "heartbeat_age_s": round(max(0.0, node.ttl - lease_left), 3),
    }


def status_reply(svc: MasterService, now: float) -> dict[str, Any]:
    """The status op: the master's leadership and every live node (read-only)."""
    coord = svc.coord.status()
    master = {
        "store": coord.get("store"),
        "leader": bool(svc.coord.is_leader),
        "leader_address": svc.coord.leader_address,
        "degraded": svc.coord.degraded,
        "replica_id": coord.get("replica_id"),
        # The registration epochs' high bits: the same for every registration of one leader
        # incarnation, different after a restart or failover.
        "epoch": svc.index.epoch_prefix,
        "uptime_s": round(time.time() - svc.started, 3),
        "locks": len(svc.index.locks),
    }
    nodes = sorted((_node_status(n, now) for n in svc.index.live_nodes(now)), key=lambda n: n["node_id"])
    return {"master": master, "nodes": nodes}
