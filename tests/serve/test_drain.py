"""Drain (pdxfer.serve.drain, `pdxfer drain`): a drained instance gets no new request while its
requests in flight finish, the command returns once none is left (bounded), only the fleet's
operator may drain, and a drained instance that restarted is back in rotation by itself. A real
proxy in front of real HTTP instances (tests/serve/test_proxy.py's FakeInstance)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdxfer.serve.drain_cli import DrainFailed, drain, main as drain_main
from pdxfer.serve.proxy import PDProxy, RunningProxy
from tests.serve.test_proxy import instances, post  # noqa: F401  (instances: a fixture)


def _complete(url: str) -> str:
    status, _, data = post(url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert status == 200, data
    return json.loads(data)["by"]


def _health(url: str) -> dict:
    """The proxy's /health document (503 too: with its only decode drained it cannot answer)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def test_a_drained_decode_finishes_its_requests_and_gets_no_new_one(instances):
    p, slow, other = instances("P"), instances("D1", delay=1.5), instances("D2")
    with RunningProxy(PDProxy([p.url], [slow.url, other.url], policy="round_robin")) as px:
        inflight: list[str] = []
        threads = [threading.Thread(target=lambda: inflight.append(_complete(px.url))) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while len(slow.received) < 2 and time.monotonic() < deadline:  # two are on the slow one
            time.sleep(0.02)
        assert len(slow.received) == 2
        t0 = time.monotonic()
        state = drain(px.url, slow.url, timeout_s=10)
        # It returned once the slow instance's two requests had ended, not before.
        assert state["in_flight"] == 0 and state["draining"] and time.monotonic() - t0 > 0.5
        for t in threads:
            t.join(10)
        assert sorted(inflight) == ["D1", "D1", "D2", "D2"]  # nothing in flight failed
        assert [_complete(px.url) for _ in range(4)] == ["D2"] * 4
        assert len(slow.received) == 2
        listed = {b["url"]: b for b in _health(px.url)["decode"]}
        assert listed[slow.url]["draining"] and not listed[other.url]["draining"]
        drain(px.url, slow.url, undo=True)
        assert "D1" in {_complete(px.url) for _ in range(4)}


def test_a_drain_that_outlasts_its_bound_says_what_is_left(instances):
    p, slow = instances("P"), instances("D", delay=3.0)
    with RunningProxy(PDProxy([p.url], [slow.url])) as px:
        t = threading.Thread(target=lambda: post(px.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}))
        t.start()
        while not slow.received:
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(DrainFailed, match="still has 1 requests in flight after 0.5 s"):
            drain(px.url, slow.url, timeout_s=0.5)
        assert time.monotonic() - t0 < 2.0
        t.join(10)


def host_address() -> str:
    """This host's own address on a non-loopback interface: a client connecting to it is, for the
    proxy, a client from elsewhere (no packet leaves: a UDP connect only picks the route)."""
    addr = "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 9))
            addr = s.getsockname()[0]
    except OSError:  # no route out: ask the interfaces
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=10).stdout.split()
        addr = next((w.split("/")[0] for i, w in enumerate(out) if out[i - 1] == "inet"), addr)
    assert not addr.startswith("127."), "this host has no non-loopback IPv4 address to test from"
    return addr


def test_only_the_fleets_operator_may_drain(instances, tmp_path, capsys):
    p, d = instances("P"), instances("D")
    with RunningProxy(PDProxy([p.url], [d.url], master_token="s3cret"), host="0.0.0.0") as px:
        remote = f"http://{host_address()}:{px.port}"  # as a client on another host reaches it
        for token in (None, "wrong"):
            with pytest.raises(DrainFailed, match="HTTP 401: this endpoint is the fleet operator's: send the"):
                drain(remote, d.url, token=token)
        assert not _health(px.url)["decode"][0]["draining"]  # nothing changed
        with pytest.raises(DrainFailed, match="HTTP 401"):  # nor learnt: 401 before the URL is looked at
            drain(remote, "http://10.9.9.9:1", token="wrong")
        with pytest.raises(DrainFailed, match="HTTP 404: no instance 'http://10.9.9.9:1'"):
            drain(remote, "http://10.9.9.9:1", token="s3cret")
        secret = tmp_path / "token"
        secret.write_text("s3cret\n")
        secret.chmod(0o600)
        assert drain_main([d.url, "--proxy", remote, "--token-file", str(secret)]) == 0
        assert "is drained" in capsys.readouterr().out
        assert _health(px.url)["decode"][0]["draining"]
    with RunningProxy(PDProxy([p.url], [d.url]), host="0.0.0.0") as px:  # no token: this host only
        with pytest.raises(DrainFailed, match="from the proxy's own host only"):
            drain(f"http://{host_address()}:{px.port}", d.url, token="anything")
        assert drain(px.url, d.url)["draining"]
        assert drain_main([d.url, "--proxy", "http://127.0.0.1:1"]) == 2  # no proxy there


def test_a_drained_instance_that_restarted_is_back_in_rotation(instances):
    p, d1, d2 = instances("P"), instances("D1"), instances("D2")
    with RunningProxy(PDProxy([p.url], [d1.url, d2.url], policy="round_robin", health_interval=0.1)) as px:
        drain(px.url, d1.url)
        assert {_complete(px.url) for _ in range(4)} == {"D2"}
        d1.healthy = False  # stopped ...
        deadline = time.monotonic() + 5
        while next(b for b in _health(px.url)["decode"] if b["url"] == d1.url)["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        d1.healthy = True  # ... and started again
        while "D1" not in {_complete(px.url) for _ in range(4)}:
            assert time.monotonic() < deadline, "the restarted instance never came back"
            time.sleep(0.05)
        assert not next(b for b in _health(px.url)["decode"] if b["url"] == d1.url)["draining"]
