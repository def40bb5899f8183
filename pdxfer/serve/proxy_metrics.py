"""The proxy's Prometheus metrics (GET /metrics on the proxy): route decisions and their
reasons, retries, failed steps, each step's time at its instance, instances taken out and
whether each is in now."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdxfer.common.metric_defs import MetricDef
from pdxfer.serve.backends import Backend

ROUTES = MetricDef("pdxfer_proxy_routes", "counter", "Requests by route: decision (prefill+decode or "
                   "decode-only), reason (why that prefill or none: skip-prefill, holder, least-loaded, "
                   "no-prefill, ...) and decode (why that decode: holder or least-loaded)",
                   ("decision", "reason", "decode"))
RETRIES = MetricDef("pdxfer_proxy_retries", "counter", "Steps retried on another instance (nothing had "
                    "reached the client), by why the first instance failed: unreachable, http_5xx, "
                    "empty_stream (closed before its first byte), bad_answer", ("role", "reason"))
STREAMS_CUT = MetricDef("pdxfer_proxy_streams_cut", "counter", "Streamed answers whose instance failed after "
                        "the first byte: the client got an SSE error event naming it, then the end of the "
                        "stream (never retried: tokens had reached the client)", ("role",))
FAILURES = MetricDef("pdxfer_proxy_step_failures", "counter",
                     "Steps that failed at an instance (unreachable, timed out, HTTP 5xx, stream cut)", ("role",))
CLIENT_KV_PARAMS = MetricDef("pdxfer_proxy_client_kv_params_dropped", "counter",
                             "Client requests that carried kv_transfer_params of their own, dropped: the hand-off "
                             "between prefill and decode is the proxy's")
TAKEN_OUT = MetricDef("pdxfer_proxy_instances_taken_out", "counter",
                      "Times an instance was taken out (failed health check or unreachable)", ("role",))
HEALTHY = MetricDef("pdxfer_proxy_instance_healthy", "gauge",
                    "1 while an instance is in rotation, 0 while it is taken out", ("role", "url"))
RECENT_BLOCKS = MetricDef("pdxfer_proxy_recent_prompt_blocks", "gauge",
                          "Blocks in the router's table of prompts recently routed to each instance, all "
                          "instances together (bounded by --recent-prompt-tokens per instance): it grows "
                          "until full, then stays")
REQUEST_SECONDS = MetricDef("pdxfer_proxy_request_seconds", "histogram",
                            "Time of one step at an instance, from sending it to the end of its answer "
                            "(a decode's includes its whole generation)", ("role", "backend"))

PROXY_METRICS: tuple[MetricDef, ...] = (ROUTES, RETRIES, STREAMS_CUT, FAILURES, CLIENT_KV_PARAMS, TAKEN_OUT,
                                        HEALTHY, RECENT_BLOCKS, REQUEST_SECONDS)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    """The proxy's Prometheus metrics, in a registry of its own (several proxies per process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routes = Counter(ROUTES.name, ROUTES.help, ROUTES.labels, registry=r)
        self.retries = Counter(RETRIES.name, RETRIES.help, RETRIES.labels, registry=r)
        self.failures = Counter(FAILURES.name, FAILURES.help, FAILURES.labels, registry=r)
        self.streams_cut = Counter(STREAMS_CUT.name, STREAMS_CUT.help, STREAMS_CUT.labels, registry=r)
        self.client_kv_params_dropped = Counter(CLIENT_KV_PARAMS.name, CLIENT_KV_PARAMS.help, registry=r)
        self.taken_out = Counter(TAKEN_OUT.name, TAKEN_OUT.help, TAKEN_OUT.labels, registry=r)
        self.healthy = Gauge(HEALTHY.name, HEALTHY.help, HEALTHY.labels, registry=r)
        self.recent_blocks = Gauge(RECENT_BLOCKS.name, RECENT_BLOCKS.help, registry=r)
        self.request_seconds = Histogram(REQUEST_SECONDS.name, REQUEST_SECONDS.help, REQUEST_SECONDS.labels,
                                         buckets=REQUEST_BUCKETS, registry=r)

    def backend_added(self, b: Backend) -> None:
        self.healthy.labels(b.role, b.url).set(1 if b.healthy else 0)

    def backend_removed(self, b: Backend) -> None:
        """Its series go with it: pods come and go with new addresses, and a series per address
        ever seen would grow without bound."""
        for metric, labels in ((self.healthy, (b.role, b.url)), (self.request_seconds, (b.role, b.url))):
            try:
                metric.remove(*labels)
            except KeyError:  # never recorded
                pass

    def backend_changed(self, b: Backend, healthy: bool) -> None:
        if not b.removed:  # a health check that ends after its backend was dropped
            self.healthy.labels(b.role, b.url).set(1 if healthy else 0)
        if not healthy:
            self.taken_out.labels(b.role).inc()

    def step_took(self, b: Backend, seconds: float) -> None:
        if not b.removed:
            self.request_seconds.labels(b.role, b.url).observe(seconds)
