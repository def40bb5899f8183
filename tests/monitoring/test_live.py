"""The monitoring files against a live stack: a real master (`python -m pdxfer.master.service`
with its HTTP port), a prefill/decode pair of `vllm serve` on the CPU behind the PD proxy, and a
real Prometheus (the example configuration, scraping every second, with the alert rules) that
scrapes all four. After a workload whose prompts share a prefix (so KV moves from the prefill to
the decode), every query of every dashboard panel must return data, the ones the workload must
move must show it, every target must be up, and no alert may be pending or firing.

The master and the pair are the run's shared default pair (tests/vllm/default_pair.py),
taken first among its users: no fault test has run on it yet. Prometheus starts here, so every
rate() sees only this module's workload (no increase before a series' first sample counts)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest

from pdxfer.common.procs import wait_http_ready
from pdxfer.launch.fleet import proxy_ready_url, start_proxy
from tests.monitoring.monitoring_files import (ALERTS, EXAMPLE_CONFIG, concrete_expr, load_alert_rules,
                                               load_dashboard, panel_queries, prometheus_tool)
from tests.monitoring.prom_server import PrometheusServer, config_from_example, positive
from tests.vllm.conftest import ask_url, prompt_of
from tests.vllm.default_pair import DefaultPair

# The pair's start (conftest READY_TIMEOUT_S) falls in this module's first test when it runs first.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.default_pair_order("first")]

PROXY_READY_S = 30  # the proxy's health checks put both running instances in
DATA_TIMEOUT_S = 45  # scrapes are 1 s apart; vLLM's stats reach /metrics a step or a log interval late
# Covers the whole run: the workload's counters still show in a rate() over it when queried.
WINDOW = "3m"
N_REQUESTS = 5
# Panel lines the workload must move, by (panel title, legend): a number above 0, not just a
# series (a rate of an untouched counter is 0, a quantile of an empty histogram NaN).
MUST_MOVE = (
    ("Prefix hit rate", "{{instance}}"),
    ("Prompt tokens loaded vs computed", "loaded {{instance}}"),
    ("Prompt tokens loaded vs computed", "computed {{instance}}"),
    ("KV load latency by phase (p50)", "lookup"),
    ("KV load latency by phase (p50)", "read"),
    ("KV load latency by phase (p50)", "total"),
    ("KV loads: ok, failed (recomputed), re-pulled", "ok {{instance}}"),
    ("Held blocks vs cap", "held {{instance}}"),
    ("Held blocks vs cap", "cap {{instance}}"),
    ("Held blocks vs cap", "indexed by the master"),
    ("Master request latency by op (p50, p99)", "p50 {{op}}"),
    ("Master leader and degraded", "leader {{instance}}"),
    ("Master lookups, locks and lock expiries", "lookups/s {{instance}}"),
    ("Proxy route decisions", "{{decision}} ({{reason}}, decode {{decode}})"),
    ("Proxy step latency by backend (p50, p99)", "p50 {{role}} {{backend}}"),
    ("Proxy backends in service", "{{role}} {{url}}"),
)


@dataclass
class LiveStack:
    prometheus: PrometheusServer
    targets: set[tuple[str, str]]  # (job, instance)
    proxy_url: str


def _host_port(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


@pytest.fixture(scope="module")
def live(default_pair_keeper: DefaultPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    prometheus_bin = prometheus_tool("prometheus")  # before minutes of vLLM start-up
    run = tmp_path_factory.mktemp("monitoring-live")
    pair = default_pair_keeper.get(tmp_path_factory)  # the module's fixture: default_pair is per test
    assert pair.master is not None
    prefill, decode = f"http://127.0.0.1:{pair.prefill_port}", f"http://127.0.0.1:{pair.decode_port}"
    proxy = None
    prom: PrometheusServer | None = None
    try:
        proxy, proxy_url = start_proxy([prefill], [decode], run, extra_args=["--master", pair.master_addr],
                                       die_with_parent=True)
        wait_http_ready(proxy_ready_url(proxy_url), PROXY_READY_S, proxy)
        jobs = {
            "pdxfer-master": [{"targets": [pair.master.http_address]}],
            "pdxfer-proxy": [{"targets": [_host_port(proxy_url)]}],
            "vllm": [{"targets": [_host_port(prefill)], "labels": {"role": "prefill"}},
                     {"targets": [_host_port(decode)], "labels": {"role": "decode"}}],
        }
        prom = PrometheusServer(prometheus_bin, config_from_example(EXAMPLE_CONFIG, jobs, ALERTS), run / "prometheus")
        live = LiveStack(prom, {(job, t) for job, cfgs in jobs.items() for c in cfgs for t in c["targets"]}, proxy_url)
        # Counters must be scraped before they move: rate() counts no increase before a series'
        # first sample, and series born with a label set at their first increment (the proxy's
        # routes and step times) are born at 1. So every target is scraped first, and each
        # request gets a scrape of its own: a route taken twice then shows in rate().
        _wait(lambda: _targets_down(live))
        for i in range(N_REQUESTS):
            _request(proxy_url, i)
            _next_scrape(prom)
        yield live
    finally:
        if prom is not None:
            prom.stop()
        if proxy is not None:
            proxy.stop(10)


def _request(proxy_url: str, i: int) -> None:
    """Request ``i`` of prompts sharing a 300-token prefix, through the proxy. Each one's own 500
    tokens are most of it, so the proxy sends it to the prefill first and the decode loads what
    the prefill computed; the shared prefix is a hit at the instance that served it before."""
    shared = prompt_of(300, seed=7100)
    answer = ask_url(proxy_url, shared + prompt_of(500, seed=7200 + i), 4, forward_hint=False)
    assert answer.tokens, f"request {i} through the proxy generated nothing"


def _next_scrape(prom: PrometheusServer, job: str = "pdxfer-proxy") -> None:
    """Wait (bounded) until Prometheus has scraped ``job`` again."""
    def last() -> float:
        got = prom.query(f'timestamp(up{{job="{job}"}})')
        return got[0]["value"] if got else 0.0

    before = last()
    _wait(lambda: [] if last() > before else ["no new scrape"], timeout=10)


def _wait(check: Callable[[], list[str]], timeout: float = DATA_TIMEOUT_S) -> list[str]:
    """Poll ``check`` (what is still wrong) until it returns nothing; what it last returned."""
    deadline = time.monotonic() + timeout
    while True:
        missing = check()
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(1.0)


def _targets_down(live: LiveStack) -> list[str]:
    got = {(s["metric"]["job"], s["metric"]["instance"]): s["value"] for s in live.prometheus.query("up")}
    return [f"{t}: {got.get(t, 'not scraped')}" for t in sorted(live.targets) if got.get(t) != 1.0] + \
           [f"unexpected target {t}" for t in sorted(set(got) - live.targets)]


def test_every_target_is_up(live: LiveStack) -> None:
    down = _wait(lambda: _targets_down(live))
    assert not down, f"targets not up: {down}"


def test_every_dashboard_query_answers(live: LiveStack) -> None:
    dash = load_dashboard()
    queries = panel_queries(dash)
    must_move = set(MUST_MOVE)
    assert must_move <= {(q.panel, q.legend) for q in queries}, "MUST_MOVE names a line the dashboard lacks"

    def unanswered() -> list[str]:
        bad = []
        for q in queries:
            samples = live.prometheus.query(concrete_expr(q.expr, dash, WINDOW))
            if not samples:
                bad.append(f"{q.panel} / {q.legend}: no data ({q.expr})")
            elif (q.panel, q.legend) in must_move and not positive(samples):
                bad.append(f"{q.panel} / {q.legend}: nothing above 0 after the workload: {samples}")
        return bad

    bad = _wait(unanswered)
    assert not bad, "dashboard queries without data:\n" + "\n".join(bad)


def test_rules_load_and_none_fires_on_a_healthy_stack(live: LiveStack) -> None:
    want = {r["alert"] for r in load_alert_rules()}

    def rules_state() -> list[str]:
        groups = live.prometheus.api("rules")["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
        bad = [f"{n}: not loaded" for n in sorted(want - set(rules))]
        bad += [f"{n}: health {r['health']} {r.get('lastError', '')}" for n, r in rules.items()
                if r["health"] != "ok"]
        bad += [f"{a['labels']['alertname']} {a['state']} ({a['labels']})"
                for a in live.prometheus.api("alerts")["alerts"]]
        return bad

    bad = _wait(rules_state)
    assert not bad, f"alert rules on a healthy stack: {bad}"
