"""The master's Prometheus metrics: one registry per service (several services may share a
process, in tests), built from ``MASTER_METRICS``.

Counts the index and the service already keep are read at scrape time by a collector (no second
copy to keep in step); request latency is a real histogram observed per request; the process's
own metrics come from prometheus_client's ProcessCollector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdxfer.master.server.metrics import MASTER_METRICS, REQUEST_BUCKETS, REQUEST_SECONDS
from pdxfer.master.server.service_stats import stats
from pdxfer.common.metric_defs import MetricDef

if TYPE_CHECKING:
    from pdxfer.master.server.master_service import MasterService

# Metric name -> the key of the values dict (see scrape_values) that holds its value.
SOURCES: dict[str, str] = {
    "pdxfer_master_nodes": "nodes",
    "pdxfer_master_entries": "entries",
    "pdxfer_master_held_blocks": "held_blocks",
    "pdxfer_master_locks": "locks",
    "pdxfer_master_connections": "connections",
    "pdxfer_master_leader": "leader_flag",
    "pdxfer_master_degraded": "degraded_flag",
    "pdxfer_master_lookups": "lookups",
    "pdxfer_master_peeks": "peeks",
    "pdxfer_master_lookup_chunks": "lookup_chunks",
    "pdxfer_master_hit_chunks": "hit_chunks",
    "pdxfer_master_hit_tokens": "hit_tokens",
    "pdxfer_master_lookup_handler_seconds": "lookup_handler_s_exact",
    "pdxfer_master_releases_ok": "releases_ok",
    "pdxfer_master_releases_expired": "releases_expired",
    "pdxfer_master_lock_expiries": "lock_expiries",
    "pdxfer_master_publish_fenced": "publish_fenced",
    "pdxfer_master_unpublish_refused": "unpublish_refused",
    "pdxfer_master_nodes_expired": "nodes_expired",
    "pdxfer_master_auth_failures": "auth_failures",
    "pdxfer_master_connections_refused": "connections_refused",
    "pdxfer_master_unproven_evicted": "unproven_evicted",
    "pdxfer_master_http_connections_cut": "http_connections_cut",
    "pdxfer_master_handshake_timeouts": "handshake_timeouts",
    "pdxfer_master_bad_frames": "bad_frames",
}

_SCRAPED = tuple(d for d in MASTER_METRICS if d.kind in ("gauge", "counter"))
_missing = [d.name for d in _SCRAPED if d.name not in SOURCES]
if _missing:  # a definition without a value would fail every scrape: fail at import instead
    raise RuntimeError(f"master metrics without a source in metrics_export.SOURCES: {_missing}")


def _family(d: MetricDef, value: float | None) -> Metric:
    cls = GaugeMetricFamily if d.kind == "gauge" else CounterMetricFamily
    return cls(d.name, d.help, value=value)


class _StatsCollector:
    """Yields the gauges and counters from ``values()`` at each scrape."""

    def __init__(self, values: Callable[[], Mapping[str, Any]]) -> None:
        self._values = values

    def describe(self) -> Iterator[Metric]:
        # Without describe() the registry would collect (read the service) when registering.
        for d in _SCRAPED:
            yield _family(d, None)

    def collect(self) -> Iterator[Metric]:
        v = self._values()
        for d in _SCRAPED:
            yield _family(d, float(v[SOURCES[d.name]]))


def scrape_values(svc: MasterService) -> dict[str, Any]:
    """The stats op's values plus the few the metrics show unrounded or as flags."""
    s = stats(svc)
    s["lookup_handler_s_exact"] = svc.lookup_seconds
    s["leader_flag"] = 1 if svc.coord.is_leader else 0
    s["degraded_flag"] = 1 if svc.coord.degraded else 0
    return s


class MasterMetrics:
    """One service's registry: its collector, its request histogram and the process collector."""

    def __init__(self, values: Callable[[], Mapping[str, Any]], ops: Mapping[int, str]) -> None:
        """``values``: what scrape_values returns; ``ops``: wire op -> its name (the op label)."""
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(values))
        hist = Histogram(REQUEST_SECONDS.name, REQUEST_SECONDS.help,
                         list(REQUEST_SECONDS.labels), buckets=REQUEST_BUCKETS, registry=self.registry)
        # One child per op up front: every op's series exists from the first scrape (a rate() of
        # an op never seen is 0, not absent), and the hot path skips the labels() lookup.
        self.observe: dict[int, Callable[[float], None]] = {
            op: hist.labels(op=name).observe for op, name in ops.items()
        }
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
