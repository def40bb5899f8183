"""pdxfer's alerting rules (deploy/monitoring/pdxfer-alerts.yml) through promtool: they load, each
fires from synthetic series in tests/monitoring/alerts_test.yml and none fires on a healthy fleet;
and the unit tests have the power to catch a broken rule (each mutation below must fail them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.monitoring_files import ALERTS, ALERTS_TEST, load_alert_rules, prometheus_tool

# A rule broken on purpose, and the unit test that must catch it: (alert, text in its expr, replacement).
MUTATIONS = (
    ("PdxferMasterDown", 'up{job="pdxfer-master"} == 0', 'up == 0'),  # any job's target
    ("PdxferNoLeader", "absent(pdxfer_master_leader == 1)", "max(pdxfer_master_leader) < 1"),  # misses "no series"
    ("PdxferMasterDegraded", "pdxfer_master_degraded == 1", "pdxfer_master_degraded == 2"),
    ("PdxferLockExpiries", "[5m])) > 0.05", "[5m])) > 0"),  # the healthy fleet's rare expiries fire
    ("PdxferMasterHostileClients", "unproven_evicted_total[5m])) > 1", "unproven_evicted_total[5m])) > 10"),  # misses a flood
    ("PdxferLoadFailures", "> 0.1", "> 0.6"),  # misses half the loads failing
    ("PdxferHeldBlocksNearCap", "and vllm:pdxfer_held_blocks_cap > 0", ""),  # fires at 0 of 0
    ("PdxferHeldBlocksNearCap", "_count[5m])) > 0)", "_count[5m])) >= 0)"),  # an idle engine's stale gauge
    ("PdxferProxyNoHealthyDecode", 'healthy{role="decode"}', 'healthy{role="prefill"}'),  # the wrong pool
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([prometheus_tool("promtool"), *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def test_rules_file_is_valid() -> None:
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(load_alert_rules())} rules found" in r.stdout


def test_alert_unit_tests_pass() -> None:
    r = promtool("test", "rules", str(ALERTS_TEST))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_fires_in_a_test_and_is_quiet_when_healthy() -> None:
    alerts = {r["alert"] for r in load_alert_rules()}
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    healthy = {c["alertname"] for c in tests[0]["alert_rule_test"] if c["exp_alerts"] == []}
    fired = {c["alertname"] for t in tests[1:] for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert healthy == alerts, f"alerts the healthy case does not check: {sorted(alerts - healthy)}"
    assert fired == alerts, f"alerts no test fires: {sorted(alerts - fired)}"
    assert {m[0] for m in MUTATIONS} == alerts, "one mutation per alert"


@pytest.mark.parametrize("alert,old,new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_unit_tests_catch_a_broken_rule(tmp_path: Path, alert: str, old: str, new: str) -> None:
    text = ALERTS.read_text()
    assert text.count(old) == 1, f"mutation of {alert}: {old!r} must occur once in {ALERTS.name}"
    broken = text.replace(old, new)
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / ALERTS.name).write_text(broken)
    assert promtool("check", "rules", str(tmp_path / "rules" / ALERTS.name)).returncode == 0, \
        f"the mutation of {alert} must still be a valid rule"
    tdir = tmp_path
    test_doc = yaml.safe_load(ALERTS_TEST.read_text())
    test_doc["rule_files"] = [str(tmp_path / "rules" / ALERTS.name)]
    (tdir / ALERTS_TEST.name).write_text(yaml.safe_dump(test_doc, sort_keys=False))
    r = promtool("test", "rules", str(tdir / ALERTS_TEST.name))
    assert r.returncode != 0, f"the alert tests passed with {alert} broken ({old!r} -> {new!r})"
    out = r.stdout + r.stderr  # promtool prints the failed cases on stderr
    assert f"alertname: {alert}," in out, out
