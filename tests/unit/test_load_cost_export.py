"""The load gate's measured costs travel from the scheduler to /metrics (vLLM's connector-stats
pipeline: PdxferKVConnectorStats, then PdxferPromMetrics) and read back as the proxy reads them
(pdxfer.serve.load_costs): floats stay floats, 0 stays "not measured"."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdxfer.vllm.scheduler.load_benefit import Piece
from pdxfer.vllm.scheduler.reader_benefit import LoadGate
from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats

MB = 1 << 20
C = 256


def _scrape(reports: list[dict]) -> str:
    """The /metrics text after vLLM observed each report (summed over an interval) in turn."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from pdxfer.vllm.connector_stats import PdxferKVConnectorStats, PdxferPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PdxferPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                             {0: ["tiny", "0"]})
    for r in reports:
        acc = PdxferKVConnectorStats(data={}).aggregate(PdxferKVConnectorStats(data=r))
        prom.observe(acc.data, 0)
    return generate_latest(reg).decode()


def test_the_gates_costs_reach_metrics_and_read_back_as_measured() -> None:
    from pdxfer.serve.load_costs import parse_costs

    gate = LoadGate(margin=0.1, stats=SchedulerStats())
    gate.bytes_per_token = MB // C
    held = {"held_blocks": 3, "held_chunks": 1, "held_blocks_cap": 16, "host_chunks": 0, "host_slots_used": 0}
    before = parse_costs(_scrape([{**held, **gate.gauges()}]))
    assert before.load_s_per_token == {} and before.compute_s_per_token is None  # 0: not measured
    for i in range(4):
        gate.step_built({"p": 1000}, [], now=float(i))
        gate.step_output(None, now=i + 0.1)
    gate.planned("r", [Piece(("a", "host"), C, MB)])
    gate.step_built(None, ["r"], now=10.0)
    gate.step_output(["r"], now=10.05)
    text = _scrape([{**held, **gate.gauges()}])
    after = parse_costs(text)
    assert after.load_s_per_token == pytest.approx({"host": 0.05 / C})  # a 1 MiB chunk in 50 ms
    assert after.compute_s_per_token == pytest.approx(1e-4)
    assert after.host_slower_than_compute() is True  # 195 us per token against 100
    samples = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    assert samples[("vllm:pdxfer_load_benefit_load_seconds_per_token", "device")] == 0.0  # never loaded
    assert samples[("vllm:pdxfer_held_blocks", None)] == 3.0  # the counts' gauges as before
