"""What the master reports about itself: the stats op, ``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

import base64
import collections
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdxfer.master.service import MasterService

# (metric name without the pdxfer_master_ prefix, type, help, key in stats())
_METRICS = (
    ("nodes", "gauge", "Registered nodes with a live lease.", "nodes"),
    ("entries", "gauge", "Published (key, node) entries.", "entries"),
    ("locks", "gauge", "Reader locks not yet released or reaped.", "locks"),
    ("lookups_total", "counter", "lookup_and_lock requests served.", "lookups"),
    ("peeks_total", "counter", "Read-only peek requests served.", "peeks"),
    ("lookup_chunks_total", "counter", "Chunks asked for in lookups.", "lookup_chunks"),
    ("hit_chunks_total", "counter", "Chunks found (contiguous prefix) in lookups.", "hit_chunks"),
    ("hit_tokens_total", "counter", "hit_chunks_total times chunk tokens.", "hit_tokens"),
    ("lookups_per_second", "gauge", "Recent lookup rate.", "lookups_per_s"),
    ("lookup_handler_seconds_total", "counter", "Time spent in the lookup handler.", "lookup_handler_s_exact"),
    ("releases_ok_total", "counter", "Releases of locks still valid.", "releases_ok"),
    ("releases_expired_total", "counter", "Releases of expired or unknown locks.", "releases_expired"),
    ("publish_fenced_total", "counter", "Publishes refused at or below their node's fence.", "publish_fenced"),
    ("unpublish_refused_total", "counter", "Unpublishes refused by a valid lock.", "unpublish_refused"),
    ("nodes_expired_total", "counter", "Nodes dropped because their lease ran out.", "nodes_expired"),
    ("auth_failures_total", "counter", "Requests refused for a missing or wrong token.", "auth_failures"),
    ("connections", "gauge", "Open client connections.", "connections"),
    ("connections_refused_total", "counter", "Connections refused at --max-connections.", "connections_refused"),
    ("handshake_timeouts_total", "counter", "Connections closed for no first frame in time.", "handshake_timeouts"),
    ("bad_frames_total", "counter", "Malformed, oversized or wrong-version messages.", "bad_frames"),
    ("leader", "gauge", "1 when this replica serves as leader.", "leader_flag"),
    ("degraded", "gauge", "1 when the store (etcd) is unreachable.", "degraded_flag"),
)


class LookupRate:
    """Lookups per second over the last few seconds, from samples the reaper takes once a second."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)

    def sample(self, now: float, lookups: int) -> None:
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, lookups))

    def per_s(self) -> float:
        s = self._samples
        if len(s) < 2:
            return 0.0
        (t0, n0), (t1, n1) = s[max(0, len(s) - 6)], s[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def stats(svc: MasterService) -> dict[str, Any]:
    s = svc.index.snapshot()
    s["hit_tokens"] = s["hit_chunks"] * svc.chunk_tokens
    s["lookups_per_s"] = round(svc.rate.per_s(), 2)
    s["lookup_handler_s"] = round(svc.lookup_seconds, 6)
    s["auth_failures"] = svc.auth_failures
    s["bad_frames"] = svc.bad_frames
    s["connections"] = len(svc._conns)
    s["connections_refused"] = svc.connections_refused
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


def metrics_text(svc: MasterService) -> str:
    s = stats(svc)
    s["lookup_handler_s_exact"] = svc.lookup_seconds
    s["leader_flag"] = 1 if svc.coord.is_leader else 0
    s["degraded_flag"] = 1 if svc.coord.degraded else 0
    lines = []
    for name, kind, help_, key in _METRICS:
        lines += [f"# HELP pdxfer_master_{name} {help_}", f"# TYPE pdxfer_master_{name} {kind}",
                  f"pdxfer_master_{name} {s[key]}"]
    return "\n".join(lines) + "\n"


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
        "blocks": sum(e.nblocks for e in node.entries.values()),
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
