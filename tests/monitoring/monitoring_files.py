"""The shipped monitoring files (deploy/monitoring) as the tests read them, and the Prometheus
tools they run: where promtool and prometheus are, the dashboard's query expressions with
Grafana's variables replaced by concrete values."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "pdxfer-dashboard.json"
ALERTS = MONITORING / "pdxfer-alerts.yml"
EXAMPLE_CONFIG = MONITORING / "prometheus.example.yml"
ALERTS_TEST = Path(__file__).resolve().parent / "alerts_test.yml"

# Grafana's interval variables, and what a test query uses instead.
INTERVAL_VARS = ("__rate_interval", "__interval", "__range")
_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def prometheus_tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``; skips (a failure under CI) when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: install Debian's prometheus package (scripts/setup.sh does, as root)")
    return path


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def load_alert_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    """Every alerting rule of a rules file, across its groups."""
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str  # as written in the dashboard, Grafana variables and all
    legend: str


def panel_queries(dash: dict[str, Any]) -> list[PanelQuery]:
    """Every query target of every panel (rows' nested panels included)."""
    out: list[PanelQuery] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets") or ():
                out.append(PanelQuery(p.get("title", ""), t.get("refId", ""), t.get("expr", ""),
                                      t.get("legendFormat", "")))
            walk(p.get("panels") or [])

    walk(dash.get("panels") or [])
    return out


def concrete_expr(expr: str, dash: dict[str, Any], interval: str) -> str:
    """``expr`` as Prometheus can run it: Grafana's interval variables become ``interval``, every
    template variable its "All" value. A variable the dashboard does not define is an error."""
    all_values = {v["name"]: v.get("allValue") or ".*"
                  for v in (dash.get("templating") or {}).get("list") or () if v.get("type") != "datasource"}

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in INTERVAL_VARS:
            return interval
        if name not in all_values:
            raise ValueError(f"expression {expr!r} uses ${name}, which the dashboard does not define "
                             f"(variables: {sorted(all_values)})")
        return all_values[name]

    return _VAR.sub(sub, expr)
