"""What each decode instance measured loads and its own prefill to cost, read from its `/metrics`.

A decode instance with ``load_benefit`` exports, per prompt token, the expected time of a typical
load from the best holder it measured in each KV tier and its own prefill time
(``vllm:pdxfer_load_benefit_load_seconds_per_token{tier}`` and
``vllm:pdxfer_load_benefit_compute_seconds_per_token``; 0: not measured). The router uses them to
decide whether a prefix that only a holder's host tier holds is worth that decode's loading.

The scraper asks every decode instance every ``interval_s`` (bounded by ``timeout_s``). It only
advises: a failed scrape never takes an instance out (the health check does that) and keeps the
last values for ``keep_s``; after that the instance counts as unmeasured (routed as without this).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdxfer.kv.tiers import HOST_TIER
from pdxfer.serve.backends import Backend, BackendPool
from pdxfer.serve.periodic import start_periodic, stop_periodic
from pdxfer.contracts.connector_metric_defs import COMPUTE_COST, LOAD_COST

log = logging.getLogger("pdxfer.proxy")

_NAMES = (LOAD_COST.name, COMPUTE_COST.name)


@dataclass(frozen=True)
class DecodeCosts:
    """One decode instance's measured costs, seconds per prompt token (None: not measured)."""

    load_s_per_token: dict[str, float]  # tier -> a typical load from that tier's best holder
    compute_s_per_token: float | None
    scraped_at: float  # time.monotonic() of the scrape that read them

    def host_slower_than_compute(self) -> bool | None:
        """True when loading from a host tier was measured slower per token than computing here,
        False when faster (or as fast), None when either is not measured."""
        host = self.load_s_per_token.get(HOST_TIER)
        if host is None or self.compute_s_per_token is None:
            return None
        return host > self.compute_s_per_token

    def as_dict(self) -> dict[str, object]:
        return {"load_s_per_token": dict(self.load_s_per_token),
                "compute_s_per_token": self.compute_s_per_token,
                "age_s": round(time.monotonic() - self.scraped_at, 3)}


def _measured(v: float) -> bool:
    return v > 0 and math.isfinite(v)


def parse_costs(text: str, scraped_at: float | None = None) -> DecodeCosts:
    """The costs in a `/metrics` page (Prometheus text). Several engines (data parallel): the
    mean of those that measured, as the proxy cannot tell which engine a request reaches."""
    # Only the two metrics' lines go to the parser: a vLLM page has thousands of others.
    lines = [ln for ln in text.splitlines() if ln.startswith(_NAMES)]
    loads: dict[str, list[float]] = {}
    compute: list[float] = []
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in fam.samples:
            if not _measured(s.value):
                continue
            if s.name == LOAD_COST.name and s.labels.get("tier"):
                loads.setdefault(s.labels["tier"], []).append(s.value)
            elif s.name == COMPUTE_COST.name:
                compute.append(s.value)
    return DecodeCosts({t: sum(v) / len(v) for t, v in loads.items()},
                       sum(compute) / len(compute) if compute else None,
                       time.monotonic() if scraped_at is None else scraped_at)


class LoadCostScraper:
    """The latest costs of each instance of ``pool`` (by URL), refreshed in the background."""

    def __init__(self, pool: BackendPool, interval_s: float, timeout_s: float, keep_s: float = 60.0) -> None:
        if interval_s <= 0 or timeout_s <= 0 or keep_s <= 0:
            raise ValueError("load cost scrape interval, timeout and keep_s must be positive")
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.keep_s = keep_s
        self._costs: dict[str, DecodeCosts] = {}
        self._failing: set[str] = set()  # URLs whose last scrape failed (logged once per run of failures)
        self._task: asyncio.Task | None = None

    def get(self, url: str) -> DecodeCosts | None:
        """What ``url`` last reported, unless that is older than ``keep_s``."""
        c = self._costs.get(url)
        if c is None or time.monotonic() - c.scraped_at > self.keep_s:
            return None
        return c

    def forget(self, url: str) -> None:
        self._costs.pop(url, None)
        self._failing.discard(url)

    async def scrape(self, session: aiohttp.ClientSession, b: Backend) -> None:
        try:
            async with session.get(b.url + "/metrics",
                                   timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                text = await r.text(errors="replace")
            costs = parse_costs(text)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            why = (f"timed out after {self.timeout_s:g} s" if isinstance(e, asyncio.TimeoutError)
                   else f"{e.__class__.__name__}: {e}")
            if b.url not in self._failing:
                self._failing.add(b.url)
                log.warning("%s instance %s: reading its load costs from /metrics failed (%s); "
                            "its last ones count for %g s more", b.role, b.url, why, self.keep_s)
            return
        if b.url in self._failing:
            self._failing.discard(b.url)
            log.info("%s instance %s: reading its load costs from /metrics works again", b.role, b.url)
        if b.removed:  # dropped from its pool while we waited
            return
        self._costs[b.url] = costs

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.scrape(session, b) for b in self.pool.backends if not b.draining))
        known = {b.url for b in self.pool.backends}
        for url in [u for u in self._costs if u not in known]:  # dropped from the pool (DNS)
            self.forget(url)

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = start_periodic("pdxfer-load-costs", self.interval_s, lambda: self.scrape_all(session))

    async def stop(self) -> None:
        await stop_periodic(self._task)
