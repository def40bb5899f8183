"""Three hosts as docs/deploy.md sets them up: a master, a prefill (holder) and a decode (reader),
each in its own network namespace on one bridge, configured only through the documented
environment (PDXFER_MASTER_LISTEN_HOST/PORT for the master; PDXFER_MASTER, PDXFER_MASTER_TOKEN_FILE,
PDXFER_LISTEN_HOST, PDXFER_ADVERTISE_HOST, PDXFER_LISTEN_PORT for the instances). The decode must
load every prompt token but the last, byte for byte, from the prefill's fixed port range.
Needs root and a working ``ip netns``."""

from __future__ import annotations

import json
import os
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
    pytest.importorskip("vllm")
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


def test_decode_loads_from_prefill_across_three_hosts(three_hosts, tmp_path):
    hosts, addrs = three_hosts
    token = tmp_path / "master.token"
    token.write_text(secrets.token_hex(16) + "\n")
    os.chmod(token, 0o600)
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
        n_tokens = 3 * CHUNK + 10
        holder = _spawn(hosts["prefill"], ["-m", "tests.transport.netns_node", "hold", "--tokens", str(n_tokens)],
                        {**common, "PDXFER_LISTEN_HOST": "0.0.0.0", "PDXFER_ADVERTISE_HOST": addrs["prefill"],
                         "PDXFER_LISTEN_PORT": HOLDER_PORTS})
        procs.append(holder)
        held = json.loads(read_prefixed_line(holder, "HELD ", 120).split(" ", 1)[1])
        assert held["published"] == n_tokens
        assert 17000 <= held["port"] <= 17003
        reader = _spawn(hosts["decode"], ["-m", "tests.transport.netns_node", "read", "--tokens", str(n_tokens)],
                        {**common, "PDXFER_LISTEN_HOST": addrs["decode"]})
        procs.append(reader)
        got = json.loads(read_prefixed_line(reader, "READ ", 120).split(" ", 1)[1])
        assert got["ext"] == n_tokens - 1, got  # every prompt token but the last
        assert not got["errors"]
        assert got["digests"] == held["digests"]  # every block of the prompt, byte for byte
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            stop(p)
