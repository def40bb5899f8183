"""Every metric the master exports on ``GET /metrics``, as definitions. The exporter
(``metrics_export.py``) builds the Prometheus metrics from this tuple and the reference page is
rendered from it, so the two cannot drift. No dependency beyond ``pdxfer.common.metric_defs``: importing
this does not import prometheus_client."""

from __future__ import annotations

from pdxfer.common.metric_defs import MetricDef

_P = "pdxfer_master_"


def _gauge(name: str, help_: str) -> MetricDef:
    return MetricDef(_P + name, "gauge", help_)


def _counter(name: str, help_: str) -> MetricDef:
    return MetricDef(_P + name, "counter", help_)


REQUEST_SECONDS = MetricDef(
    _P + "request_seconds", "histogram",
    "Time the master spent handling one request, by wire op (the handler only: no network, no queueing).",
    ("op",),
)

# A lookup of a long prompt takes tens of microseconds in the handler; a second is far past trouble.
REQUEST_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)

MASTER_METRICS: tuple[MetricDef, ...] = (
    _gauge("nodes", "Registered nodes with a live lease."),
    _gauge("entries", "Published (key, node) entries."),
    _gauge("held_blocks", "KV blocks covered by published entries, summed over all nodes."),
    _gauge("locks", "Reader locks not yet released or reaped."),
    _gauge("connections", "Open client connections."),
    _gauge("leader", "1 when this replica serves as leader."),
    _gauge("degraded", "1 when the store (etcd) is unreachable."),
    _counter("lookups", "lookup_and_lock requests served."),
    _counter("peeks", "Read-only peek requests served."),
    _counter("lookup_chunks", "Chunks asked for in lookups."),
    _counter("hit_chunks", "Chunks found (contiguous prefix) in lookups."),
    _counter("hit_tokens", "Hit chunks times the chunk size in tokens."),
    _counter("lookup_handler_seconds", "Time spent in the lookup handler."),
    _counter("releases_ok", "Releases of locks still valid."),
    _counter("releases_expired", "Releases of expired or unknown locks."),
    _counter("lock_expiries", "Locks reaped at their deadline without every release (a reader that never released)."),
    _counter("publish_fenced", "Publishes refused at or below their node's fence."),
    _counter("unpublish_refused", "Unpublishes refused by a valid lock."),
    _counter("nodes_expired", "Nodes dropped because their lease ran out."),
    _counter("auth_failures", "Requests refused for a missing or wrong token."),
    _counter("connections_refused", "Connections refused at --max-connections (every slot held by a client "
             "that proved itself)."),
    _counter("unproven_evicted", "Connections cut before they proved themselves (no accepted hello or request) "
             "to make room for a newcomer: at --max-connections, or past --max-unproven-per-peer from one "
             "address."),
    _counter("http_connections_cut", "HTTP (/metrics, /health) connections cut while still waiting for their "
             "request, to make room at the HTTP port's cap of 64."),
    _counter("handshake_timeouts", "Connections closed for no first frame in time."),
    _counter("bad_frames", "Malformed, oversized or wrong-version messages."),
    REQUEST_SECONDS,
)
