"""The proxy's Prometheus metrics (GET /metrics on the proxy): route decisions and their
reasons, retries, failed steps, instances taken out and whether each is in now."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdxfer.serve.backends import Backend


class ProxyMetrics:
    """The proxy's Prometheus metrics, in a registry of its own (several proxies per process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routes = Counter("pdxfer_proxy_routes", "Requests by route decision and reason",
                              ["decision", "reason", "decode"], registry=r)
        self.retries = Counter("pdxfer_proxy_retries", "Steps retried on another instance",
                               ["role"], registry=r)
        self.failures = Counter("pdxfer_proxy_step_failures", "Steps that failed at an instance",
                                ["role"], registry=r)
        self.taken_out = Counter("pdxfer_proxy_instances_taken_out",
                                 "Times an instance was taken out (health check or unreachable)",
                                 ["role"], registry=r)
        self.healthy = Gauge("pdxfer_proxy_instance_healthy", "1 while an instance is in",
                             ["role", "url"], registry=r)

    def backend_changed(self, b: Backend, healthy: bool) -> None:
        self.healthy.labels(b.role, b.url).set(1 if healthy else 0)
        if not healthy:
            self.taken_out.labels(b.role).inc()
