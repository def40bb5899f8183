"""One metric's definition: its name, kind, help text and labels, as the code that exports it
declares it. Every part (master, proxy, connector) builds its Prometheus metrics from a tuple of
these, and ``pdxfer.docgen.metrics`` renders the same tuples into ``docs/metrics.md``, so the reference
page cannot drift from what is exported. No dependency: importable without prometheus_client or
vLLM."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricDef:
    name: str  # as scraped, without the _total/_bucket suffix the client library adds
    kind: str  # one of KINDS
    help: str
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: give a counter's name without _total (the client adds it)")

    def exposed_names(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this metric."""
        if self.kind == "counter":
            return (self.name + "_total",)
        if self.kind == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)
