"""The proxy finds its decode instances through DNS (``--decode=dns+http://NAME:PORT``), with the
system's own resolver: no resolver is mocked.

The proxy runs as a child process in a mount namespace of its own, where a temporary hosts file
is bind-mounted over /etc/hosts (and a host.conf with ``multi on``, so that glibc answers every
line of a name listed several times, and a resolv.conf naming a DNS server that is not there, so
that a name missing from the hosts file fails at once). Three stand-in instances listen on
127.0.0.2, 127.0.0.3 and 127.0.0.4 at one port; the hosts file, rewritten in place (the bind
mount shows the same inode), decides which of them the name resolves to.

Needs root and unshare(1) (util-linux).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
from aiohttp import web

from pdxfer.serve.discovery import DnsSource, addresses, parse_dns_spec, split_specs

from .stand_ins import ROOT, StandIn, StandInApp

NAME = "decode.pdxfer.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def _why_no_namespace() -> str | None:
    """What is missing for a mount namespace with our own /etc/hosts, or None."""
    if os.geteuid() != 0:
        return "not root: bind-mounting a hosts file in a mount namespace needs root"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare(1) or mount(8) (util-linux)"
    missing = [f for f in ("/etc/hosts", "/etc/host.conf", "/etc/resolv.conf") if not os.path.exists(f)]
    if missing:
        return f"no {', '.join(missing)} to bind-mount the test's own over"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare -m with a bind mount failed here: {probe.stderr.strip()}"
    return None


class Sites:
    """StandInApps served at one port on several loopback addresses, from one background loop."""

    def __init__(self, apps: dict[str, StandInApp]) -> None:
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self.port = 0
        ready = threading.Event()
        error: list[BaseException] = []

        async def bind_all(port: int) -> None:
            for host, app in apps.items():
                runner = web.AppRunner(app.app, access_log=None)
                await runner.setup()
                self._runners.append(runner)
                await web.TCPSite(runner, host, port).start()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            for _ in range(20):  # a port free on the first address may be taken on another
                with socket.socket() as s:
                    s.bind((next(iter(apps)), 0))
                    port = s.getsockname()[1]
                try:
                    self._loop.run_until_complete(bind_all(port))
                    self.port = port
                    break
                except OSError as e:
                    error[:] = [e]
                    self._loop.run_until_complete(self._cleanup())
            ready.set()
            if self.port:
                self._loop.run_forever()
                self._loop.run_until_complete(self._cleanup())

        self._thread = threading.Thread(target=run, daemon=True, name="stand-in-sites")
        self._thread.start()
        assert ready.wait(30) and self.port, f"stand-ins did not start: {error}"

    async def _cleanup(self) -> None:
        for r in self._runners:
            await r.cleanup()
        self._runners.clear()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return r.status, json.loads(r.read())


class ProxyInNamespace:
    """`pdxfer proxy` in its own mount namespace, resolving through ``etc``'s files."""

    def __init__(self, tmp: Path, args: list[str], first: list[str]) -> None:
        self.etc = tmp / "etc"
        self.etc.mkdir(parents=True)
        self.hosts = self.etc / "hosts"
        self.set_hosts(first)  # before the proxy's first resolution
        (self.etc / "host.conf").write_text("multi on\n")
        # A name not in the hosts file fails at once: no DNS server answers here.
        (self.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        port_file = tmp / "proxy.port"
        self.log = tmp / "proxy.log"
        mounts = " && ".join(f"mount --bind {self.etc / f} /etc/{f}"
                             for f in ("hosts", "host.conf", "resolv.conf"))
        cmd = " ".join([sys.executable, "-m", "pdxfer.cli", "proxy", "--port", "0",
                        "--port-file", str(port_file), *args])
        self._log_f = self.log.open("wb")
        self.proc = subprocess.Popen(["unshare", "-m", "sh", "-c", f"{mounts} && exec {cmd}"],
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdout=self._log_f, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: port_file.exists() or self.proc.poll() is not None, 30, "proxy start")
            assert self.proc.poll() is None, f"the proxy exited: {self.log.read_text()}"
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def set_hosts(self, addrs: list[str]) -> None:
        """Rewritten in place (the bind mount shows this inode), new text first and the cut
        after: a resolution in between reads whole lines, never an empty file (which would be
        a failed resolution the test did not make)."""
        text = ("127.0.0.1 localhost\n" + "".join(f"{a} {NAME}\n" for a in addrs)).encode()
        with open(self.hosts, "r+b" if self.hosts.exists() else "wb") as f:
            f.write(text)
            f.truncate()

    def health(self) -> dict[str, Any]:
        return json.loads(_get(self.url + "/health")[1])

    def decode_urls(self) -> dict[str, bool]:
        """Each decode instance the proxy lists -> whether it is draining."""
        return {b["url"]: bool(b.get("draining")) for b in self.health()["decode"]}

    def metrics(self) -> str:
        return _get(self.url + "/metrics")[1].decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_f.close()


@pytest.fixture
def fleet(tmp_path: Path):
    why = _why_no_namespace()
    if why is not None:
        pytest.skip(why)  # under CI this fails (tests/conftest.py), naming what is missing
    apps = {h: StandInApp(f"D{h.rsplit('.', 1)[1]}") for h in HOSTS}
    sites = Sites(apps)
    prefill = StandIn("P")
    proxies: list[ProxyInNamespace] = []

    def start(first: list[str], *more: str) -> ProxyInNamespace:
        args = ["--prefill", prefill.url, "--decode", f"dns+http://{NAME}:{sites.port}",
                "--policy", "round_robin", "--discovery-interval", "0.2",
                "--discovery-timeout", "2", "--health-interval", "0.2", *more]
        px = ProxyInNamespace(tmp_path / f"px{len(proxies)}", args, first)
        proxies.append(px)
        return px

    try:
        yield start, apps, sites.port, prefill
    finally:
        for px in proxies:
            px.stop()
        prefill.stop()
        sites.stop()


def _decodes_of(apps: dict[str, StandInApp]) -> dict[str, int]:
    return {h: len(a.received) for h, a in apps.items()}


def test_dns_backends_follow_the_hosts_file(fleet) -> None:
    start, apps, port, prefill = fleet
    url = {h: f"http://{h}:{port}" for h in HOSTS}
    px = start(list(HOSTS[:2]))
    assert set(px.decode_urls()) == {url[HOSTS[0]], url[HOSTS[1]]}, px.health()

    # Both addresses of the name get requests; the third, listening but not in DNS, none.
    for i in range(6):
        assert _post(px.url + "/v1/completions", {"prompt": f"a{i}"})[0] == 200
    got = _decodes_of(apps)
    assert got[HOSTS[0]] > 0 and got[HOSTS[1]] > 0 and got[HOSTS[2]] == 0, got
    assert f'pdxfer_proxy_instance_healthy{{role="decode",url="{url[HOSTS[0]]}"}} 1.0' in px.metrics()

    # A third line: a third decode, in rotation once the proxy has resolved again.
    px.set_hosts(list(HOSTS))
    wait_for(lambda: url[HOSTS[2]] in px.decode_urls(), 20, "the third address in the proxy's list")
    before = _decodes_of(apps)
    for i in range(6):
        assert _post(px.url + "/v1/completions", {"prompt": f"b{i}"})[0] == 200
    after = _decodes_of(apps)
    assert all(after[h] > before[h] for h in HOSTS), (before, after)

    # A stream in flight on 127.0.0.3 when its line goes: it finishes; nothing new goes there.
    victim = apps[HOSTS[1]]
    victim.gate = threading.Event()
    held = None
    for i in range(3):  # round robin over three: one of three lands on the victim
        req = urllib.request.Request(px.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": f"s{i}", "stream": True}).encode())
        r = urllib.request.urlopen(req, timeout=20)  # returns with the headers, after the first event
        if r.headers["X-Pdxfer-Decode"] == url[HOSTS[1]]:
            held = r
            break
        r.read()
        r.close()
    assert held is not None, "no stream reached 127.0.0.3"
    try:
        px.set_hosts([HOSTS[0], HOSTS[2]])
        wait_for(lambda: px.decode_urls().get(url[HOSTS[1]]) is True, 20, "127.0.0.3 draining")
        n_victim = len(victim.received)
        for i in range(6):
            assert _post(px.url + "/v1/completions", {"prompt": f"c{i}"})[0] == 200
        assert len(victim.received) == n_victim, "a draining instance got a new request"
        assert px.decode_urls().get(url[HOSTS[1]]) is True, "dropped while a request was in flight"
        (entry,) = [b for b in px.health()["decode"] if b["url"] == url[HOSTS[1]]]
        assert entry["in_flight"] == 1 and entry["source"] == f"dns+http://{NAME}:{port}", entry
    finally:
        victim.gate.set()
    events = [ln for ln in held.read().decode().splitlines() if ln.startswith("data: ")]
    held.close()
    assert events[-1] == "data: [DONE]" and len(events) == 5, events
    assert all("error" not in e for e in events), events
    wait_for(lambda: url[HOSTS[1]] not in px.decode_urls(), 20, "127.0.0.3 dropped once idle")
    # Its series go too: a fleet whose pods keep new addresses must not grow the metrics forever.
    assert url[HOSTS[1]] not in px.metrics()
    assert f'url="{url[HOSTS[2]]}"' in px.metrics()

    # The name fails to resolve: the last known instances stay, and the failure is logged once.
    px.set_hosts([])
    wait_for(lambda: any(d["error"] for d in px.health()["dns"]), 20, "the failed resolution in /health")
    checks = prefill.health_checks  # health checks and resolutions both run every 0.2 s
    wait_for(lambda: prefill.health_checks >= checks + 4, 20, "a few more rounds")
    assert set(px.decode_urls()) == {url[HOSTS[0]], url[HOSTS[2]]}
    assert _post(px.url + "/v1/completions", {"prompt": "d"})[0] == 200
    px.set_hosts([HOSTS[0]])
    wait_for(lambda: set(px.decode_urls()) == {url[HOSTS[0]]}, 20, "resolving again, one address")
    log = px.log.read_text()
    assert log.count(f"resolving dns+http://{NAME}:{port} failed") == 1, log
    assert log.count(f"dns+http://{NAME}:{port} resolves again") == 1, log


def test_the_index_names_a_dns_found_pod_by_its_serve_url(fleet, tmp_path) -> None:
    """A pod's connector registers serve_url http://<its address>:PORT; the proxy knows the pod
    by the URL it makes of that address's DNS record: the two are equal, so the router sends a
    prompt to the decode pod holding it."""
    from pdxfer.kv.keys import Namespace
    from pdxfer.master import MasterClient, NodeInfo, start_local_master
    from pdxfer.serve.index_view import lookup_keys

    from .stand_ins import stand_in_tokens

    start, apps, port, _ = fleet
    chunk = 16
    root = Namespace("tiny", "content-fp", chunk).root()
    prompt = "".join(f"w{i:03d} " for i in range(40))  # 200 tokens
    tokens = stand_in_tokens({"prompt": prompt})
    master = start_local_master(workdir=tmp_path / "master")
    client = MasterClient(master.address, timeout_s=5.0)
    try:
        holder = f"http://{HOSTS[2]}:{port}"  # what the pod's PDXFER_SERVE_URL would say
        info = NodeInfo("decode-pod-4", 0, "tcp", b"meta", {"v": 1, "block_size": chunk}, "fp-test",
                        serve_url=holder, namespace=root.hex(), chunk_tokens=chunk, role="kv_consumer")
        client.register_node(info, 60)
        keys, _ = lookup_keys(tokens, chunk, root)
        assert client.publish("decode-pod-4", [(k, [i]) for i, k in enumerate(keys)]) == len(keys)
        px = start(list(HOSTS), "--master", master.address)
        wait_for(lambda: len(px.decode_urls()) == 3, 20, "three decode pods")
        for _ in range(3):  # not round robin's turn: the holder each time
            req = urllib.request.Request(px.url + "/v1/completions", data=json.dumps({"prompt": prompt}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=20) as r:
                assert r.headers["x-pdxfer-route"] == f"decode-only={holder}", dict(r.headers)
                assert "decode=holder" in r.headers["x-pdxfer-route-reason"]
        assert len(apps[HOSTS[2]].received) == 3
        assert len(apps[HOSTS[0]].received) == len(apps[HOSTS[1]].received) == 0
    finally:
        client.close()
        master.stop()


# ---- parsing, without a namespace -----------------------------------------------------------

def test_dns_backend_specs_are_checked() -> None:
    s = parse_dns_spec("decode", "dns+http://pdxfer-decode-pods:8000/")
    assert s == DnsSource("decode", "dns+http://pdxfer-decode-pods:8000", "http", "pdxfer-decode-pods", 8000)
    assert s.url_for("10.1.2.3") == "http://10.1.2.3:8000"
    assert s.url_for("fd00::7") == "http://[fd00::7]:8000"
    assert parse_dns_spec("prefill", "dns+https://p:443").url_for("10.0.0.1") == "https://10.0.0.1:443"
    for bad, msg in (("dns+http://pods", "needs a port"), ("dns+http://:8000", "no name"),
                     ("dns+http://pods:8000/v1", "only dns"), ("dns+http://pods:99999", "decode backend"),
                     ("dns+http://u@pods:8000", "only dns")):
        with pytest.raises(ValueError, match=msg):
            parse_dns_spec("decode", bad)
    assert split_specs("decode", ["http://a:1", "dns+http://b:2"]) == (["http://a:1"], [parse_dns_spec("decode", "dns+http://b:2")])
    with pytest.raises(ValueError, match="given twice"):
        split_specs("decode", ["dns+http://b:2", "dns+http://b:2/"])
    with pytest.raises(ValueError, match="no prefill instance"):
        split_specs("prefill", [])
    infos = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 80)),
             (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 80, 0, 0)),
             (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 80))]
    assert addresses(infos) == ["10.0.0.1", "fd00::1"]


def test_discovery_leaves_static_urls_alone_and_revives_a_returning_address() -> None:
    from pdxfer.serve.backends import BackendPool
    from pdxfer.serve.discovery import Discovery

    pool = BackendPool.from_urls("decode", ["http://10.0.0.1:8000"], "least_loaded")
    src = parse_dns_spec("decode", "dns+http://pods:8000")
    added, removed = [], []
    d = Discovery([pool], [src], on_added=added.append, on_removed=removed.append)
    want = {src.url_for(a): src for a in ("10.0.0.1", "10.0.0.2")}
    d._apply(pool, want)
    assert [b.url for b in pool.backends] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert [b.url for b in added] == ["http://10.0.0.2:8000"]  # the static one is not DNS's
    pool.backends[1].in_flight = 1
    d._apply(pool, {})  # both gone from DNS: the static one stays, the other drains
    assert [(b.url, b.draining) for b in pool.backends] == [("http://10.0.0.1:8000", False),
                                                             ("http://10.0.0.2:8000", True)]
    assert pool.pick(last_resort=True).url == "http://10.0.0.1:8000" and not removed
    d._apply(pool, want)  # back before it was dropped: the same backend, in rotation again
    assert not pool.backends[1].draining and pool.backends[1].in_flight == 1 and not removed
    pool.backends[1].in_flight = 0
    d._apply(pool, {})
    assert [b.url for b in pool.backends] == ["http://10.0.0.1:8000"]
    assert [b.url for b in removed] == ["http://10.0.0.2:8000"] and removed[0].removed


def test_a_name_that_does_not_resolve_leaves_an_empty_pool_and_a_clear_503() -> None:
    from pdxfer.serve.proxy import PDProxy, RunningProxy

    prefill = StandIn("P")
    try:
        px = PDProxy([prefill.url], ["dns+http://no-such-decode.invalid:8000"], discovery_timeout=5)
        with RunningProxy(px) as run:
            try:
                _post(run.url + "/v1/completions", {"prompt": "x"})
                raise AssertionError("a request was answered with no decode instance")
            except urllib.error.HTTPError as e:
                assert e.code == 503
                err = json.loads(e.read())["error"]
            assert err["role"] == "decode" and "none known" in err["message"], err
            status, body = _get(run.url + "/health")
            (dns,) = json.loads(body)["dns"]
            assert status == 503 and dns["instances"] == [] and dns["error"], dns
    finally:
        prefill.stop()
    with pytest.raises(ValueError, match="needs a port"):
        PDProxy([prefill.url], ["dns+http://pods"])
    with pytest.raises(ValueError, match="discovery interval and timeout must be positive"):
        PDProxy([prefill.url], ["dns+http://pods:1"], discovery_interval=0)
