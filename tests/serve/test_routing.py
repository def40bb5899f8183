"""Routing from the master's index, through a real master process: the test publishes a prompt's
keys as fake holders (MasterClient, as a connector would: same namespace root, same keys) whose
registrations name aiohttp stand-ins (tests/serve/stand_ins.py) as their serve_url; the proxy
tokenizes with a stand-in's /tokenize, peeks at the master and routes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from pdxfer.kv.keys import Namespace, chunk_hashes, tail_key
from pdxfer.master import MasterClient, NodeInfo, start_local_master
from pdxfer.serve.index_view import IndexView, lookup_keys
from pdxfer.serve.proxy import PDProxy, RunningProxy
from pdxfer.serve.router import RouteConfig

from .stand_ins import ROOT as REPO_ROOT
from .stand_ins import StandIn, load_cost_page, stand_in_tokens
from .test_fleet_proxy import health, metric, post, wait_for

C = 16
NS = Namespace("tiny", "content-fp", C)
ROOT = NS.root()
PROMPT = "".join(f"w{i:03d} " for i in range(40))  # 200 tokens: 12 full chunks + a 8-token tail
assert len(PROMPT) == 200


@pytest.fixture(scope="module")
def master(tmp_path_factory) -> Iterator[Any]:
    m = start_local_master(workdir=tmp_path_factory.mktemp("master"))
    yield m
    m.stop()


class Fleet:
    """Stand-ins, fake holder registrations naming them, and proxies; all undone at the end."""

    def __init__(self, master_address: str) -> None:
        self.address = master_address
        self.client = MasterClient(master_address, timeout_s=5.0)
        self.nodes: list[str] = []
        self.stand_ins: list[StandIn] = []
        self.proxies: list[RunningProxy] = []

    def instance(self, name: str) -> StandIn:
        s = StandIn(name)
        self.stand_ins.append(s)
        return s

    def hold(self, inst: StandIn, tokens: list[int], n_keys: int | None = None,
             role: str = "kv_producer", in_host_tier: bool = False) -> None:
        """``inst`` publishes the first ``n_keys`` lookup keys of ``tokens`` (all: None), in its
        KV cache or (``in_host_tier``) as host slots after its 100 device blocks."""
        node_id = f"{inst.name}-{len(self.nodes)}-{time.monotonic_ns()}"
        layout: dict[str, Any] = {"v": 1, "block_size": C}
        if in_host_tier:
            layout.update(num_blocks=100, host_tier={})
        info = NodeInfo(node_id, 0, "tcp", b"meta", layout, "fp-test",
                        serve_url=inst.url, namespace=ROOT.hex(), chunk_tokens=C, role=role)
        self.client.register_node(info, 60)
        self.nodes.append(node_id)
        keys, _ = lookup_keys(tokens, C, ROOT)
        keys = keys if n_keys is None else keys[:n_keys]
        first = 100 if in_host_tier else 0
        assert self.client.publish(node_id, [(k, [first + i]) for i, k in enumerate(keys)]) == len(keys)

    def proxy(self, prefill: list[StandIn], decode: list[StandIn], health_interval: float = 2.0,
              **route: Any) -> RunningProxy:
        """A proxy routing from the index only, unless ``recent_prompt_tokens`` is given: a
        stand-in has no prefix cache for the recent prompts to estimate."""
        route.setdefault("recent_prompt_tokens", 0)
        px = RunningProxy(PDProxy([p.url for p in prefill], [d.url for d in decode],
                                  master=self.address, route=RouteConfig(**route),
                                  health_interval=health_interval, health_timeout=1.0))
        self.proxies.append(px)
        return px

    def close(self) -> None:
        for px in self.proxies:
            px.stop()
        for n in self.nodes:
            try:
                self.client.deregister_node(n)
            except Exception:  # noqa: BLE001 - a stopped master is the test's own doing
                pass
        self.client.close()
        for s in self.stand_ins:
            s.stop()


@pytest.fixture
def fleet(master) -> Iterator[Fleet]:
    f = Fleet(master.address)
    yield f
    f.close()


def tokens_of(prompt: str) -> list[int]:
    return stand_in_tokens({"prompt": prompt})


def route_of(px: RunningProxy, body: dict[str, Any], path: str = "/v1/completions"
             ) -> tuple[str, str, dict[str, Any]]:
    status, headers, data = post(px.url + path, body)
    assert status == 200, data
    return headers["x-pdxfer-route"], headers["x-pdxfer-route-reason"], json.loads(data)


def test_the_views_keys_are_the_connectors_lookup_keys() -> None:
    tokens = tokens_of(PROMPT)
    keys, n_full = lookup_keys(tokens, C, ROOT)
    full = chunk_hashes(tokens, C, ROOT)
    assert n_full == 12 and keys == full + [tail_key(full[-1], tokens[12 * C:])]
    keys, n_full = lookup_keys(tokens[:192], C, ROOT)  # on a chunk boundary: no tail key
    assert n_full == 12 and keys == full


def test_nothing_held_goes_to_the_least_loaded(fleet) -> None:
    p, d = fleet.instance("P"), fleet.instance("D")
    fleet.hold(p, tokens_of("something else entirely " * 4))  # announces the namespace
    px = fleet.proxy([p], [d], skip_prefill_tokens=32)
    route, reason, _ = route_of(px, {"model": "tiny", "prompt": PROMPT})
    assert route == f"prefill={p.url} decode={d.url}"
    assert reason.startswith("least-loaded; decode=least-loaded; held=0/200")
    assert d.tokenized == [{"model": "tiny", "prompt": PROMPT}]  # asked the decode to tokenize


def test_the_prefill_goes_to_the_instance_holding_the_longest_prefix(fleet) -> None:
    p0, p1, p2 = fleet.instance("P0"), fleet.instance("P1"), fleet.instance("P2")
    d = fleet.instance("D")
    t = tokens_of(PROMPT)
    fleet.hold(p0, t, 3)
    fleet.hold(p2, t, 8)  # 128 tokens: 72 left, more than the 32 a decode may compute itself
    px = fleet.proxy([p0, p1, p2], [d], skip_prefill_tokens=32)
    for _ in range(3):  # not by turns: every time
        route, reason, _ = route_of(px, {"prompt": PROMPT})
        assert route == f"prefill={p2.url} decode={d.url}"
        assert reason.startswith("prefill-holder; decode=least-loaded; held=128/200")
    assert len(p2.received) == 3 and not p0.received and not p1.received
    assert metric(px, "pdxfer_proxy_routes_total", decision="prefill+decode",
                  reason="prefill-holder") == 3


def test_a_prefix_in_an_instances_host_tier_counts_as_held_but_not_as_its_own_cache(fleet) -> None:
    """P0 holds 10 chunks only in its host tier: other readers can load them (held=160), but P0's
    own prefix cache has none of them, so the prefill goes to P1, whose KV cache holds 6."""
    p0, p1, d = fleet.instance("P0"), fleet.instance("P1"), fleet.instance("D")
    t = tokens_of(PROMPT)
    fleet.hold(p0, t, 10, in_host_tier=True)
    fleet.hold(p1, t, 6)
    px = fleet.proxy([p0, p1], [d], skip_prefill_tokens=32)
    for _ in range(2):
        route, reason, _ = route_of(px, {"prompt": PROMPT})
        assert route == f"prefill={p1.url} decode={d.url}", reason
        assert reason.startswith("prefill-holder; decode=least-loaded; held=160/200")
    assert not p0.received


def _costs_read(px: RunningProxy, d: StandIn) -> bool:
    """The proxy read ``d``'s /metrics (measured or not) since the stand-in last changed it."""
    (entry,) = [b for b in health(px)["decode"] if b["url"] == d.url]
    return "load_costs" in entry


@pytest.mark.parametrize("page, skips", [
    ({"host": 2e-3, "device": 1e-5, "compute": 1e-4}, False),  # host loads 20x slower than computing
    ({"host": 2e-5, "device": 1e-5, "compute": 1e-4}, True),  # ... 5x faster
    ({}, True),  # load_benefit off (or nothing measured yet): every gauge 0, as without them
    (None, True),  # a /metrics without pdxfer's gauges at all
], ids=["host-slower", "host-faster", "unmeasured", "no-gauges"])
def test_a_prefix_only_a_host_tier_holds_counts_as_held_only_where_loading_it_pays(
        fleet, caplog, page, skips) -> None:
    """P holds the whole prompt in its host tier only. The decode that measured host loads
    slower per token than its own prefill would decline that load and compute the prompt, so
    the router does not skip the prefill for it; measured faster, or not measured, it does."""
    caplog.set_level(logging.INFO, "pdxfer.proxy")
    p, d = fleet.instance("P"), fleet.instance("D")
    if page is not None:
        d.metrics_text = load_cost_page(**page)
    t = tokens_of(PROMPT)
    fleet.hold(p, t, in_host_tier=True)
    px = fleet.proxy([p], [d], skip_prefill_tokens=32)
    wait_for(lambda: _costs_read(px, d), 10, "the decode's load costs read")
    route, reason, _ = route_of(px, {"prompt": PROMPT})
    if skips:
        assert route == f"decode-only={d.url}"
        assert reason == "skip-prefill; decode=least-loaded; held=200/200; left=1"
    else:
        assert route == f"prefill={p.url} decode={d.url}"
        assert reason == "least-loaded; decode=least-loaded; held=200/200; host=200 recompute"
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route ")]
        assert logged == [f"route /v1/completions prefill={p.url} decode={d.url}; {reason}"]


def test_a_host_only_rest_past_a_device_prefix_is_left_to_compute_where_host_loads_are_slow(fleet) -> None:
    """P1's KV cache holds 6 chunks (96 tokens), P0's host tier the whole prompt: with host loads
    measured slow, 104 tokens are left (prefill on P1, which holds the 96); with a threshold above
    that the decode loads the 96 and computes the rest. Each decode is judged by its own costs."""
    p0, p1 = fleet.instance("P0"), fleet.instance("P1")
    slow, fast = fleet.instance("Dslow"), fleet.instance("Dfast")
    slow.metrics_text = load_cost_page(host=2e-3, device=1e-5, compute=1e-4, engines=2)
    fast.metrics_text = load_cost_page(host=2e-5, device=1e-5, compute=1e-4)
    t = tokens_of(PROMPT)
    fleet.hold(p0, t, in_host_tier=True)
    fleet.hold(p1, t, 6)
    tight = fleet.proxy([p0, p1], [slow], skip_prefill_tokens=32)
    loose = fleet.proxy([p0, p1], [slow], skip_prefill_tokens=104)
    other = fleet.proxy([p0, p1], [fast], skip_prefill_tokens=32)
    for px, d in ((tight, slow), (loose, slow), (other, fast)):
        wait_for(lambda px=px, d=d: _costs_read(px, d), 10, "the decode's load costs read")
    route, reason, _ = route_of(tight, {"prompt": PROMPT})
    assert route == f"prefill={p1.url} decode={slow.url}"
    assert reason == "prefill-holder; decode=least-loaded; held=200/200; host=104 recompute"
    route, reason, _ = route_of(loose, {"prompt": PROMPT})
    assert route == f"decode-only={slow.url}"
    assert reason == "skip-prefill; decode=least-loaded; held=200/200; host=104 recompute; left=104"
    route, reason, _ = route_of(other, {"prompt": PROMPT})
    assert route == f"decode-only={fast.url}"
    assert reason == "skip-prefill; decode=least-loaded; held=200/200; left=1"


def test_a_prompt_the_fleet_holds_skips_the_prefill_on_the_holding_decode(fleet, caplog) -> None:
    caplog.set_level(logging.INFO, "pdxfer.proxy")
    p = fleet.instance("P")
    d0, d1 = fleet.instance("D0"), fleet.instance("D1")
    t = tokens_of(PROMPT)
    fleet.hold(d1, t, role="kv_consumer")  # every chunk and the tail: the whole prompt
    px = fleet.proxy([p], [d0, d1])
    for _ in range(2):
        route, reason, out = route_of(px, {"prompt": PROMPT, "max_tokens": 5})
        assert route == f"decode-only={d1.url}" and out["by"] == "D1"
        assert reason.startswith("skip-prefill; decode=holder; held=200/200; left=1")
    assert p.received == [] and not d0.received
    assert d1.received[0][1] == {"prompt": PROMPT, "max_tokens": 5}  # untouched, no hint
    assert metric(px, "pdxfer_proxy_routes_total", decision="decode-only", reason="skip-prefill",
                  decode="holder") == 2
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route ")]
    assert logged == [f"route /v1/completions decode-only={d1.url}; skip-prefill; decode=holder; "
                      "held=200/200; left=1"] * 2


def test_the_skip_threshold_in_tokens_and_as_a_fraction(fleet) -> None:
    p, d = fleet.instance("P"), fleet.instance("D")
    t = tokens_of(PROMPT)
    fleet.hold(p, t, 10)  # 160 of 200 held: 40 left
    by_tokens_40 = fleet.proxy([p], [d], skip_prefill_tokens=40)
    by_tokens_39 = fleet.proxy([p], [d], skip_prefill_tokens=39)
    by_fraction = fleet.proxy([p], [d], skip_prefill_tokens=0, skip_prefill_fraction=0.2)
    assert route_of(by_tokens_40, {"prompt": PROMPT})[0] == f"decode-only={d.url}"
    assert route_of(by_tokens_39, {"prompt": PROMPT})[1].startswith("prefill-holder")
    route, reason, _ = route_of(by_fraction, {"prompt": PROMPT})
    assert route == f"decode-only={d.url}" and reason.startswith("skip-prefill; decode=least-loaded")
    # A short prompt nobody holds is computed by the decode too: a prefill would cost more.
    route, reason, _ = route_of(by_tokens_40, {"prompt": "short and new"})
    assert route == f"decode-only={d.url}" and reason.startswith("short-prompt")



SYSTEM = "".join(f"s{i:02d} " for i in range(16))  # 64 tokens: 4 chunks, both decodes hold them


def test_a_conversations_next_turn_goes_to_the_decode_that_served_its_last(fleet) -> None:
    """Both decodes hold the system prompt's chunks, so the index ties them; only the one that
    served turn 1 holds turn 1 in its own prefix cache. With recent prompts counted, turn 2 goes
    there and, with little left to compute, skips the prefill; once that decode was taken out
    (it may have restarted), nothing recent counts for it any more."""
    p, d0, d1 = fleet.instance("P"), fleet.instance("D0"), fleet.instance("D1")
    assert len(SYSTEM) == 64
    for d in (d0, d1):
        fleet.hold(d, tokens_of(SYSTEM), role="kv_consumer")
    turn1 = SYSTEM + "u" * 100  # 164 tokens: 100 left after the system prompt
    turn2 = turn1 + "a" * 20 + "v" * 20  # 204: turn 1's 10 whole blocks are 160 of them
    turn3 = turn2 + "w" * 20
    by_name = {d0.url: d0, d1.url: d1}

    index_only = fleet.proxy([p], [d0, d1], skip_prefill_tokens=48)
    route, reason, _ = route_of(index_only, {"prompt": turn1})
    assert route.startswith(f"prefill={p.url}") and reason.startswith("least-loaded; decode=holder")
    route, reason, _ = route_of(index_only, {"prompt": turn2})
    assert route.startswith(f"prefill={p.url}"), reason  # 140 left by the index alone
    assert reason.startswith("least-loaded; decode=holder; held=64/204")

    px = fleet.proxy([p], [d0, d1], skip_prefill_tokens=48, recent_prompt_tokens=4096,
                     health_interval=0.1)
    route, reason, _ = route_of(px, {"prompt": turn1})
    served = by_name[route.split("decode=")[1]]
    route, reason, out = route_of(px, {"prompt": turn2})
    assert route == f"decode-only={served.url}" and out["by"] == served.name
    assert reason == "skip-prefill; decode=holder; held=64/204; own=160; left=44"
    # The table's size: turn 1's 10 blocks at the prefill and at ``served``, which also has
    # turn 2's 2 more.
    assert metric(px, "pdxfer_proxy_recent_prompt_blocks") == 10 + 12

    served.healthy = False
    wait_for(lambda: not all(b["healthy"] for b in health(px)["decode"]), 5, "taken out")
    served.healthy = True
    wait_for(lambda: all(b["healthy"] for b in health(px)["decode"]), 5, "put back")
    assert metric(px, "pdxfer_proxy_recent_prompt_blocks") == 10
    route, reason, _ = route_of(px, {"prompt": turn3})
    assert route.startswith(f"prefill={p.url}"), reason  # the prefill still counts turn 1
    assert reason == "prefill-holder; decode=holder; held=64/224"


def test_a_chat_is_tokenized_with_its_template_fields(fleet) -> None:
    p, d = fleet.instance("P"), fleet.instance("D")
    messages = [{"role": "system", "content": PROMPT[:100]}, {"role": "user", "content": PROMPT[100:]}]
    body = {"model": "tiny", "messages": messages, "tools": [{"type": "function"}],
            "chat_template_kwargs": {"x": 1}, "add_generation_prompt": True, "temperature": 0}
    t = stand_in_tokens(body)
    fleet.hold(d, t, role="kv_consumer")
    px = fleet.proxy([p], [d])
    route, reason, _ = route_of(px, body, "/v1/chat/completions")
    assert route == f"decode-only={d.url}" and reason.startswith("skip-prefill")
    (asked,) = d.tokenized
    assert asked == {k: body[k] for k in ("model", "messages", "tools", "chat_template_kwargs",
                                           "add_generation_prompt")}


def test_requests_the_index_cannot_name_are_routed_without_it(fleet) -> None:
    p, d = fleet.instance("P"), fleet.instance("D")
    fleet.hold(d, tokens_of(PROMPT), role="kv_consumer")
    px = fleet.proxy([p], [d])
    assert route_of(px, {"prompt": PROMPT, "cache_salt": "s"})[1].startswith("cache-salt")
    assert route_of(px, {"prompt": [PROMPT, PROMPT]})[1].startswith("multi-prompt")
    # Token ids in the request: no tokenize round trip, the same decision.
    route, reason, _ = route_of(px, {"prompt": tokens_of(PROMPT)})
    assert route == f"decode-only={d.url}" and reason.startswith("skip-prefill")
    assert d.tokenized == []


def test_a_master_that_is_down_or_frozen_never_fails_a_request(tmp_path: Path) -> None:
    m = start_local_master(workdir=tmp_path)
    f = Fleet(m.address)
    try:
        p, d = f.instance("P"), f.instance("D")
        f.hold(d, tokens_of(PROMPT), role="kv_consumer")
        px = f.proxy([p], [d], index_timeout_s=0.5)
        assert route_of(px, {"prompt": PROMPT})[0] == f"decode-only={d.url}"
        os.kill(m.proc.pid, signal.SIGSTOP)  # frozen: connections hang, nothing answers
        try:
            t0 = time.monotonic()
            route, reason, _ = route_of(px, {"prompt": PROMPT})
            assert time.monotonic() - t0 < 3
            assert route == f"prefill={p.url} decode={d.url}"
            assert reason.startswith(("index-timeout", "index-down")), reason
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        m.kill()
        m.proc.stop(5)
        for _ in range(3):  # refused at once, then not asked again for a while
            t0 = time.monotonic()
            route, reason, _ = route_of(px, {"prompt": PROMPT})
            assert time.monotonic() - t0 < 3
            assert route == f"prefill={p.url} decode={d.url}" and reason.startswith("index-")
        assert metric(px, "pdxfer_proxy_routes_total", reason="skip-prefill") == 1
    finally:
        f.close()
        m.stop()


def test_an_index_view_refuses_what_it_cannot_use(master) -> None:
    with pytest.raises(ValueError, match="timeout"):
        IndexView(master.address, timeout_s=0)
    with pytest.raises(ValueError, match="skip_prefill_fraction"):
        RouteConfig(skip_prefill_fraction=1.5)
    with pytest.raises(ValueError, match="skip_prefill_tokens"):
        RouteConfig(skip_prefill_tokens=-1)


def test_a_bad_master_address_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        PDProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], master="not an address")
    bad = subprocess.run([sys.executable, "-m", "pdxfer.cli", "proxy", "--prefill", "http://127.0.0.1:1",
                          "--decode", "http://127.0.0.1:2", "--master", "http://x:1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "unknown scheme" in bad.stderr


def test_a_busy_holder_is_passed_over_for_the_least_loaded() -> None:
    """A hot prefix must not pin all its traffic to its holder: a holder more than
    holder_max_extra_load requests busier than the least loaded instance is passed over."""
    from pdxfer.serve.backends import BackendPool
    from pdxfer.serve.index_view import Holding
    from pdxfer.serve.router import Router

    prefill = BackendPool.from_urls("prefill", ["http://p0:1", "http://p1:1"], "least_loaded")
    decode = BackendPool.from_urls("decode", ["http://d0:1", "http://d1:1"], "least_loaded")
    for b in prefill.backends + decode.backends:
        b.healthy = True
    router = Router(prefill, decode, index=None, cfg=RouteConfig(skip_prefill_tokens=16, holder_max_extra_load=2))
    held = Holding(prompt_tokens=600, held_tokens=512, by_url={"http://p1:1": 512, "http://d1:1": 512})
    prefill.backends[1].in_flight = decode.backends[1].in_flight = 2  # at the bound: still the holders
    route = router.decide(held)
    assert (route.prefill.url, route.reason, route.decode.url, route.decode_reason) == \
        ("http://p1:1", "prefill-holder", "http://d1:1", "holder")
    prefill.backends[1].in_flight = decode.backends[1].in_flight = 3  # past it: the idle ones
    route = router.decide(held)
    assert (route.prefill.url, route.reason, route.decode.url, route.decode_reason) == \
        ("http://p0:1", "least-loaded", "http://d0:1", "least-loaded")
    with pytest.raises(ValueError, match="holder_max_extra_load"):
        RouteConfig(holder_max_extra_load=-1)
