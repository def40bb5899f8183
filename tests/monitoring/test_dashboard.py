"""The Grafana dashboard (deploy/monitoring/pdxfer-dashboard.json): well formed, every panel
query valid PromQL once Grafana's variables are replaced (promtool parses them as recording
rules), and the panels cover what an operator of pdxfer watches."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.monitoring_files import (concrete_expr, load_dashboard, panel_queries,
                                               prometheus_tool)
from pdxfer.contracts.phase_times import PHASES

# Series the panels must read (the dashboard's purpose, one entry per thing watched).
REQUIRED_SERIES = (
    "vllm:pdxfer_lookup_hit_tokens_total", "vllm:prompt_tokens_total",  # prefix hit rate
    "vllm:pdxfer_tokens_loaded_total", "vllm:prompt_tokens_by_source_total",  # loaded vs computed
    *(f"vllm:pdxfer_phase_{p}_seconds_bucket" for p in PHASES),  # load latency by phase
    "vllm:pdxfer_loads_failed_total",  # failed (recomputed) loads
    "vllm:pdxfer_held_blocks", "vllm:pdxfer_held_blocks_cap",
    "pdxfer_master_request_seconds_bucket", "pdxfer_master_leader", "pdxfer_master_degraded",
    "pdxfer_proxy_routes_total", "pdxfer_proxy_request_seconds_bucket",
)
_NAME = re.compile(r"[a-zA-Z_:][\w:]*")  # metric names, and PromQL's words, which do no harm here


def test_dashboard_is_well_formed() -> None:
    dash = load_dashboard()
    panels = dash["panels"]
    assert dash["uid"] and dash["title"] and panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    var_names = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in var_names
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_panel_queries_parse(tmp_path: Path) -> None:
    dash = load_dashboard()
    rules = [{"record": f"dashboard:panel_{i}", "expr": concrete_expr(q.expr, dash, "1m")}
             for i, q in enumerate(panel_queries(dash))]
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_quantiles_keep_the_bucket_label() -> None:
    # histogram_quantile over a sum that dropped `le` returns nothing: a silently empty panel.
    for q in panel_queries(load_dashboard()):
        if "histogram_quantile" in q.expr:
            assert re.search(r"by \((\w+, )*le[,)]", q.expr) and "_bucket" in q.expr, f"{q.panel}: {q.expr}"


def test_panels_cover_what_is_watched() -> None:
    used = {name for q in panel_queries(load_dashboard()) for name in _NAME.findall(q.expr)}
    missing = [s for s in REQUIRED_SERIES if s not in used]
    assert not missing, f"no panel reads {missing}"


def test_concrete_expr_replaces_every_variable() -> None:
    dash = load_dashboard()
    for q in panel_queries(dash):
        assert "$" not in concrete_expr(q.expr, dash, "30s"), q.expr
    assert concrete_expr('rate(x{instance=~"$instance"}[$__rate_interval])', dash, "30s") == \
        'rate(x{instance=~".*"}[30s])'
    with pytest.raises(ValueError, match=r"\$nope"):
        concrete_expr("rate(x{a=~\"$nope\"}[1m])", dash, "30s")
