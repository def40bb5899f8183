"""Reading each decode instance's measured load costs from its /metrics (pdxfer.serve.load_costs):
parsed from real Prometheus text, scraped over real sockets from stand-ins; a failed scrape
keeps the last values for a bounded time and never takes an instance out."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import aiohttp
import pytest

from pdxfer.serve.backends import BackendPool
from pdxfer.serve.load_costs import DecodeCosts, LoadCostScraper, parse_costs
from pdxfer.contracts.connector_metric_defs import COMPUTE_COST, LOAD_COST

from .stand_ins import StandIn, load_cost_page


def test_the_costs_are_read_from_a_metrics_page() -> None:
    c = parse_costs(load_cost_page(host=2e-3, device=1e-5, compute=1e-4))
    assert c.load_s_per_token == pytest.approx({"host": 2e-3, "device": 1e-5})
    assert c.compute_s_per_token == pytest.approx(1e-4)
    assert c.host_slower_than_compute() is True
    assert parse_costs(load_cost_page(host=5e-5, compute=1e-4)).host_slower_than_compute() is False


def test_zero_means_not_measured() -> None:
    c = parse_costs(load_cost_page(device=1e-5))  # host never loaded from, prefill not measured
    assert c.load_s_per_token == pytest.approx({"device": 1e-5}) and c.compute_s_per_token is None
    assert c.host_slower_than_compute() is None
    assert parse_costs(load_cost_page(host=1e-3)).host_slower_than_compute() is None
    c = parse_costs("")  # an instance without pdxfer's connector
    assert c.load_s_per_token == {} and c.compute_s_per_token is None


def test_several_engines_count_as_their_mean_over_those_that_measured() -> None:
    c = parse_costs(load_cost_page(host=3e-3, compute=1e-4, engines=2))
    assert c.load_s_per_token == pytest.approx({"host": 3e-3}) and c.compute_s_per_token == pytest.approx(1e-4)
    # Engine 2 has measured nothing yet (0; a NaN is no measurement either): 0 and 1 count.
    page = "".join(f'{LOAD_COST.name}{{model_name="m",engine="{e}",tier="host"}} {v}\n'
                   for e, v in enumerate(("0.003", "0.001", "NaN")))
    page += "".join(f'{COMPUTE_COST.name}{{model_name="m",engine="{e}"}} {v}\n'
                    for e, v in enumerate(("0.0001", "0.0003", "0.0")))
    c = parse_costs(page)
    assert c.load_s_per_token == pytest.approx({"host": 2e-3}) and c.compute_s_per_token == pytest.approx(2e-4)


@pytest.fixture
def decodes() -> Iterator[list[StandIn]]:
    made = [StandIn("D0"), StandIn("D1")]
    yield made
    for s in made:
        s.stop()


def _scrape(scraper: LoadCostScraper) -> None:
    async def once() -> None:
        async with aiohttp.ClientSession() as session:
            await scraper.scrape_all(session)

    asyncio.run(once())


def _values(c: DecodeCosts | None) -> Any:
    return None if c is None else (c.load_s_per_token, c.compute_s_per_token)


def test_a_failed_scrape_keeps_the_last_costs_for_a_while_and_takes_nothing_out(decodes, caplog) -> None:
    d0, d1 = decodes
    pool = BackendPool.from_urls("decode", [d0.url, d1.url], "least_loaded")
    scraper = LoadCostScraper(pool, interval_s=5.0, timeout_s=1.0, keep_s=0.5)
    d0.metrics_text = load_cost_page(host=2e-3, compute=1e-4)
    _scrape(scraper)
    assert _values(scraper.get(d0.url)) == ({"host": 2e-3}, 1e-4)
    assert _values(scraper.get(d1.url)) == ({}, None)  # read, nothing measured
    d0.metrics_status = 500
    d1.stop()  # refused
    with caplog.at_level("WARNING", "pdxfer.proxy"):
        _scrape(scraper)
        _scrape(scraper)
    assert _values(scraper.get(d0.url)) == ({"host": 2e-3}, 1e-4)  # the last values still count
    warned = [r.getMessage() for r in caplog.records if "load costs" in r.getMessage()]
    assert len(warned) == 2 and "HTTP 500" in warned[0] + warned[1]  # once per instance, not per scrape
    assert all(b.healthy for b in pool.backends)  # only the health check takes an instance out
    scraper.keep_s = 0.0  # ... for a bounded time: then the instance counts as unmeasured
    assert scraper.get(d0.url) is None and scraper.get(d1.url) is None
    scraper.keep_s = 60.0
    d0.metrics_status = 200
    d0.metrics_text = load_cost_page(host=5e-5, compute=1e-4)
    _scrape(scraper)
    assert _values(scraper.get(d0.url)) == ({"host": 5e-5}, 1e-4)
    pool.backends = pool.backends[:1]  # D1 left the pool (DNS): its costs go with it
    _scrape(scraper)
    assert d1.url not in scraper._costs


def test_a_scrape_that_hangs_is_bounded(decodes) -> None:
    d0, _ = decodes
    pool = BackendPool.from_urls("decode", [d0.url], "least_loaded")
    scraper = LoadCostScraper(pool, interval_s=5.0, timeout_s=0.3)
    d0.metrics_text = load_cost_page(host=2e-3, compute=1e-4)
    _scrape(scraper)
    d0.metrics_delay = 2.0
    t0 = time.monotonic()
    _scrape(scraper)
    assert time.monotonic() - t0 < 1.5  # 0.3 s, with room for a busy machine
    assert _values(scraper.get(d0.url)) == ({"host": 2e-3}, 1e-4)


def test_bad_settings_are_refused() -> None:
    pool = BackendPool.from_urls("decode", ["http://127.0.0.1:1"], "least_loaded")
    with pytest.raises(ValueError, match="interval"):
        LoadCostScraper(pool, interval_s=0, timeout_s=1)
