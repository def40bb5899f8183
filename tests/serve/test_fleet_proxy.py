"""The proxy in front of a fleet: health checks, retries on another instance, the decode computing
when no prefill can, the client's headers on both steps, unbuffered streams. Real sockets: the
instances are aiohttp stand-ins (tests/serve/stand_ins.py), some in child processes that are
SIGKILLed in the middle of a burst."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from pdxfer.serve.backends import load_backends_file
from pdxfer.serve.proxy import PDProxy, RunningProxy

from .stand_ins import ROOT, StandIn, StandInProcess

FAST_HEALTH = {"health_interval": 0.1, "health_timeout": 1.0}


@pytest.fixture
def stand_ins(tmp_path: Path):
    made: list[Any] = []

    def make(name: str, delay: float = 0.0, process: bool = False, gap: float = 0.0) -> Any:
        s = StandInProcess(name, tmp_path, delay, gap) if process else StandIn(name, delay, gap)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 20) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def health(px: RunningProxy) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(px.url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def metric(px: RunningProxy, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(px.url + "/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_flapping_instance_is_taken_out_and_put_back(stand_ins) -> None:
    p, d0, d1 = stand_ins("P"), stand_ins("D0"), stand_ins("D1")
    with RunningProxy(PDProxy([p.url], [d0.url, d1.url], policy="round_robin", **FAST_HEALTH)) as px:
        d1.healthy = False
        wait_for(lambda: not health(px)["decode"][1]["healthy"], 5, "D1 taken out")
        assert "HTTP 503" in health(px)["decode"][1]["down_reason"]
        before = len(d1.received)
        for i in range(6):
            status, headers, _ = post(px.url + "/v1/completions", {"prompt": f"out {i}"})
            assert status == 200 and headers["x-pdxfer-route"] == f"prefill={p.url} decode={d0.url}"
        assert len(d1.received) == before
        d1.healthy = True
        wait_for(lambda: health(px)["decode"][1]["healthy"], 5, "D1 put back")
        for i in range(4):
            assert post(px.url + "/v1/completions", {"prompt": f"back {i}"})[0] == 200
        assert len(d1.received) == before + 2  # round robin over both again
        d0.healthy = d1.healthy = False
        wait_for(lambda: not any(b["healthy"] for b in health(px)["decode"]), 5, "both out")
        status, headers, _ = post(px.url + "/v1/completions", {"prompt": "none"})
        # Both out (their health checks fail) but still answering: tried all the same.
        assert status == 200 and "decode=last-resort" in headers["x-pdxfer-route-reason"]
        with pytest.raises(urllib.error.HTTPError) as proxy_health:  # a balancer in front sees it
            urllib.request.urlopen(px.url + "/health", timeout=5)
        assert proxy_health.value.code == 503
        assert metric(px, "pdxfer_proxy_instances_taken_out_total", role="decode") == 3


def _burst(px: RunningProxy, n: int, body: Callable[[int], dict[str, Any]]
           ) -> list[tuple[int, dict[str, str], bytes]]:
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(post, px.url + "/v1/completions", body(i), None, 30) for i in range(n)]
        return [f.result() for f in futs]


def _in_flight(px: RunningProxy, role: str, url: str) -> int:
    return next(b["in_flight"] for b in health(px)[role] if b["url"] == url)


def test_a_prefill_killed_mid_burst_loses_no_request(stand_ins) -> None:
    victim = stand_ins("P-victim", delay=1.0, process=True)
    survivor = stand_ins("P-survivor", delay=0.2)
    d = stand_ins("D")
    with RunningProxy(PDProxy([victim.url, survivor.url], [d.url], policy="round_robin",
                              **FAST_HEALTH)) as px:
        results: list[Any] = []
        t = threading.Thread(target=lambda: results.extend(
            _burst(px, 6, lambda i: {"prompt": f"burst {i}", "max_tokens": 4})))
        t0 = time.monotonic()
        t.start()
        wait_for(lambda: _in_flight(px, "prefill", victim.url) >= 2, 20, "requests on the victim")
        victim.kill()
        t.join(30)
        took = time.monotonic() - t0
        routes = [h["x-pdxfer-route"] for s, h, _ in results]
        assert [s for s, _, _ in results] == [200] * 6, results
        # Every request was still prefilled: the victim's in-flight ones again on the survivor.
        assert routes == [f"prefill={survivor.url} decode={d.url}"] * 6
        assert len(d.received) == 6 and all(b["max_tokens"] == 4 for _, b, _ in d.received)
        assert metric(px, "pdxfer_proxy_retries_total", role="prefill") >= 2
        assert metric(px, "pdxfer_proxy_retries_total", role="prefill", reason="unreachable") >= 2
        assert not health(px)["prefill"][0]["healthy"]
        assert took < 10


def test_a_decode_killed_mid_burst_retries_before_the_first_byte(stand_ins) -> None:
    p = stand_ins("P")
    victim = stand_ins("D-victim", delay=1.0, process=True)
    survivor = stand_ins("D-survivor", delay=0.2)
    with RunningProxy(PDProxy([p.url], [victim.url, survivor.url], policy="round_robin",
                              **FAST_HEALTH)) as px:
        results: list[Any] = []
        t = threading.Thread(target=lambda: results.extend(
            _burst(px, 6, lambda i: {"prompt": f"burst {i}", "stream": True})))
        t.start()
        wait_for(lambda: _in_flight(px, "decode", victim.url) >= 2, 20, "requests on the victim")
        victim.kill()
        t.join(30)
        assert [s for s, _, _ in results] == [200] * 6, results
        for _, headers, data in results:
            events = [e for e in data.decode().split("\n\n") if e.strip()]
            assert events[-1] == "data: [DONE]"
            assert [json.loads(e[6:]) for e in events[:-1]] == [
                {"i": i, "by": "D-survivor"} for i in range(4)]
            assert headers["x-pdxfer-route"] == f"prefill={p.url} decode={survivor.url}"
        assert metric(px, "pdxfer_proxy_retries_total", role="decode") >= 2


def test_a_decode_dying_after_its_first_byte_ends_the_stream_with_an_error_event(stand_ins) -> None:
    """Tokens reached the client: no retry (it would repeat them), a clean error event naming
    the instance and the end of the stream, counted; the client never hangs."""
    p = stand_ins("P")
    victim = stand_ins("D-victim", process=True, gap=30.0)
    with RunningProxy(PDProxy([p.url], [victim.url], **FAST_HEALTH)) as px:
        req = urllib.request.Request(px.url + "/v1/completions",
                                     json.dumps({"prompt": "cut", "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=20) as r:
            first = r.readline() + r.readline()  # the first event and its blank line
            assert json.loads(first.decode()[6:]) == {"i": 0, "by": "D-victim"}
            victim.kill()
            rest = r.read().decode()
        took = time.monotonic() - t0
        cut, retried = (metric(px, "pdxfer_proxy_streams_cut_total", role="decode"),
                        metric(px, "pdxfer_proxy_retries_total", role="decode"))
    events = [e for e in rest.split("\n\n") if e.strip()]
    assert len(events) == 1 and events[0].startswith("data: "), rest
    err = json.loads(events[0][6:])["error"]
    assert err["code"] == 502 and err["instance"] == victim.url and "failed mid-stream" in err["message"]
    assert took < 10  # ended by the instance's death, not by a read timeout
    assert (cut, retried) == (1, 0)
    assert len(p.received) == 1


def test_a_decode_failing_twice_is_a_clear_error(stand_ins) -> None:
    p = stand_ins("P")
    a, b = stand_ins("DA", delay=0.5, process=True), stand_ins("DB", delay=0.5, process=True)
    with RunningProxy(PDProxy([p.url], [a.url, b.url], **FAST_HEALTH)) as px:
        results: list[Any] = []
        t = threading.Thread(target=lambda: results.extend(_burst(px, 2, lambda i: {"prompt": "x"})))
        t.start()
        wait_for(lambda: _in_flight(px, "decode", a.url) + _in_flight(px, "decode", b.url) >= 2, 10,
                 "both requests at a decode")
        a.kill()
        b.kill()
        t.join(30)
    for status, _, data in results:
        err = json.loads(data)["error"]
        assert status in (502, 503) and err["role"] == "decode"
        assert a.url in err["message"] or b.url in err["message"] or err.get("instances")


def test_no_healthy_prefill_means_the_decode_computes_and_says_so(stand_ins) -> None:
    p, d = stand_ins("P"), stand_ins("D")
    with RunningProxy(PDProxy([p.url], [d.url], **FAST_HEALTH)) as px:
        p.healthy = False
        wait_for(lambda: not health(px)["prefill"][0]["healthy"], 5, "P taken out")
        status, headers, data = post(px.url + "/v1/completions", {"prompt": "x"})
        assert status == 200 and json.loads(data)["by"] == "D"
        assert headers["x-pdxfer-route"] == f"decode-only={d.url}"
        assert headers["x-pdxfer-route-reason"].startswith("no-prefill")
        assert p.received == []
        assert metric(px, "pdxfer_proxy_routes_total", decision="decode-only", reason="no-prefill") == 1


def test_the_clients_headers_reach_both_steps_and_hop_by_hop_ones_stop(stand_ins) -> None:
    p, d = stand_ins("P"), stand_ins("D")
    with RunningProxy(PDProxy([p.url], [d.url])) as px:
        conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=20)
        body = json.dumps({"prompt": "x", "max_tokens": 3}).encode()
        conn.request("POST", "/v1/completions", body, {
            "Content-Type": "application/json", "Authorization": "Bearer sk-fleet",
            "X-Request-Id": "req-42", "Connection": "keep-alive, X-Hop-Only",
            "X-Hop-Only": "private", "Keep-Alive": "timeout=5", "TE": "trailers"})
        r = conn.getresponse()
        out = r.read()
        assert r.status == 200, out
        assert r.getheader("X-Answered-By") == "D"  # the decode's own response headers come back
        conn.close()
    for inst in (p, d):
        (_, _, raw), = inst.received
        got = {k.lower(): v for k, v in raw.items()}
        assert got["authorization"] == "Bearer sk-fleet" and got["x-request-id"] == "req-42"
        for hop in ("x-hop-only", "keep-alive", "te"):
            assert hop not in got, (inst.name, hop)


def test_streamed_events_pass_through_unbuffered(stand_ins) -> None:
    p, d = stand_ins("P"), stand_ins("D")
    d.gate = threading.Event()
    with RunningProxy(PDProxy([p.url], [d.url])) as px:
        conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
        # The decode holds its second event until we have read the first through the proxy: a
        # proxy that buffers would leave this read waiting until the socket timeout.
        first = r.readline()
        assert json.loads(first.decode()[6:]) == {"i": 0, "by": "D"}
        d.gate.set()
        rest = r.read().decode()
        conn.close()
    assert rest.strip().endswith("data: [DONE]") and '"i": 3' in rest


def test_backends_from_a_file_and_bad_files(tmp_path: Path, stand_ins) -> None:
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps({"prefill": ["http://127.0.0.1:1", "http://127.0.0.1:2/"],
                             "decode": ["http://127.0.0.1:3"]}))
    assert load_backends_file(f) == (["http://127.0.0.1:1", "http://127.0.0.1:2/"],
                                     ["http://127.0.0.1:3"])
    for text, msg in (("[1]", "must hold an object"), ('{"prefil": []}', "unknown key"),
                      ('{"decode": "http://x"}', "must be a list"), ("{", "is not JSON")):
        f.write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_backends_file(f)
    with pytest.raises(ValueError, match="given twice"):
        PDProxy(["http://a:1", "http://a:1/"], ["http://b:1"])
    # Through the CLI: a fleet from a file, plus a flag.
    p0, p1, d = stand_ins("P0"), stand_ins("P1"), stand_ins("D")
    f.write_text(json.dumps({"prefill": [p0.url], "decode": [d.url]}))
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "pdxfer.cli", "proxy", "--backends", str(f),
                             "--prefill", p1.url, "--port", "0", "--port-file", str(port_file),
                             "--policy", "round_robin"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(port_file.exists, 20, "the proxy's port file")
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        for i in range(4):
            assert post(url + "/v1/completions", {"prompt": f"f{i}"})[0] == 200
        assert (len(p0.received), len(p1.received), len(d.received)) == (2, 2, 4)
    finally:
        proc.kill()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "pdxfer.cli", "proxy", "--backends",
                          str(tmp_path / "missing.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode != 0 and "missing.json" in bad.stderr and "cannot read" in bad.stderr


def test_each_steps_time_is_recorded_per_instance(stand_ins) -> None:
    p, d_slow, d_fast = stand_ins("P"), stand_ins("Dslow", delay=0.3), stand_ins("Dfast")
    with RunningProxy(PDProxy([p.url], [d_slow.url, d_fast.url], policy="round_robin", **FAST_HEALTH)) as px:
        for i in range(4):
            assert post(px.url + "/v1/completions", {"prompt": f"timed {i}"})[0] == 200
        name = "pdxfer_proxy_request_seconds"
        assert metric(px, name + "_count", role="prefill", backend=p.url) == 4
        assert metric(px, name + "_count", role="decode", backend=d_slow.url) == 2
        assert metric(px, name + "_count", role="decode", backend=d_fast.url) == 2
        # The slow instance's answers took at least its delay each; the fast one's much less.
        assert metric(px, name + "_sum", role="decode", backend=d_slow.url) >= 2 * 0.3
        assert metric(px, name + "_sum", role="decode", backend=d_fast.url) < 2 * 0.3
        assert metric(px, name + "_bucket", role="decode", backend=d_slow.url, le="0.25") == 0
