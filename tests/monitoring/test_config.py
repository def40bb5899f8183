"""The example Prometheus configuration (deploy/monitoring/prometheus.example.yml) is one
Prometheus accepts, with the rules file it names, and has the scrape jobs the alerts select."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.monitoring.monitoring_files import ALERTS, EXAMPLE_CONFIG, load_alert_rules, prometheus_tool


def test_example_config_is_valid_with_its_rules(tmp_path: Path) -> None:
    # As an operator installs it: both files in one directory (rule_files is relative to the config).
    for f in (EXAMPLE_CONFIG, ALERTS):
        shutil.copy(f, tmp_path / f.name)
    r = subprocess.run([prometheus_tool("promtool"), "check", "config", str(tmp_path / EXAMPLE_CONFIG.name)],
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "SUCCESS: 1 rule files found" in out and f"{ALERTS.name}\n  SUCCESS: " in out, out


def test_example_config_rejects_a_missing_rules_file(tmp_path: Path) -> None:
    # The oracle above sees the rules file: without it promtool must fail.
    shutil.copy(EXAMPLE_CONFIG, tmp_path / EXAMPLE_CONFIG.name)
    r = subprocess.run([prometheus_tool("promtool"), "check", "config", str(tmp_path / EXAMPLE_CONFIG.name)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and ALERTS.name in r.stdout + r.stderr


def test_alerts_select_jobs_the_example_scrapes() -> None:
    cfg = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    jobs = {s["job_name"] for s in cfg["scrape_configs"]}
    assert {"pdxfer-master", "pdxfer-proxy", "vllm"} <= jobs
    assert cfg["rule_files"] == [ALERTS.name]
    selected = {m for r in load_alert_rules() for m in re.findall(r'job="([^"]+)"', r["expr"])}
    assert selected and selected <= jobs, f"jobs the alerts select but the example does not scrape: {selected - jobs}"
