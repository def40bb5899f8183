"""Inside the soft-RoCE guest: the two rxe devices as pyverbs and pdxfer-probe --devices see them;
and the host probe tests (test_devices_host.py) on a host that has RDMA devices."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pdxfer.probe import devices

from .conftest import HOLDER_DEV, READER_DEV
from .test_devices_host import (  # noqa: F401  (collected here: their with-devices branch runs only in here)
    pyverbs,
    test_probe_devices_json_gives_a_clean_answer_on_this_host,
    test_probe_devices_text_is_one_rdma_line_then_topology_without_rdma,
)


def _wait_active(dev: str, timeout: float = 20.0) -> None:
    state = Path(f"/sys/class/infiniband/{dev}/ports/1/state")
    deadline = time.monotonic() + timeout
    while "ACTIVE" not in state.read_text():
        assert time.monotonic() < deadline, f"{dev} port 1 not ACTIVE {timeout} s after its netdev came up"
        time.sleep(0.1)


def test_pyverbs_sees_two_active_rxe_devices_with_roce_v2_gids():
    devs, reason = devices.rdma_devices()
    assert reason is None, reason
    by_name = {d["name"]: d for d in devs}
    assert {READER_DEV, HOLDER_DEV} <= set(by_name), f"devices: {sorted(by_name)}"
    for ip, name in (("192.168.77.1", READER_DEV), ("192.168.77.2", HOLDER_DEV)):
        (port,) = by_name[name]["ports"]
        assert port["state"] == "ACTIVE", port
        assert port["link_layer"] == "Ethernet", port
        assert port["active_mtu"] == 4096 and port["max_mtu"] == 4096, port  # veth MTU 9000
        v2 = [g for g in port["gids"] if g["type"] == "RoCE v2" and g["ipv4"] == ip]
        assert v2, f"{name}: no RoCE v2 GID for {ip}: {port['gids']}"
    assert devices.warnings_for(devs) == []


def test_probe_devices_json_in_the_guest():
    res = subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", "--devices", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout)
    assert "reason" not in rep and rep["warnings"] == []
    assert sorted(d["name"] for d in rep["devices"]) == sorted({READER_DEV, HOLDER_DEV})
    ucx = rep["ucx"]
    assert ucx["available"], ucx
    for dev in (READER_DEV, HOLDER_DEV):
        assert "rc_verbs" in ucx["transports"].get(f"{dev}:1", []), ucx["transports"]


def test_probe_devices_warns_when_a_port_goes_down():
    # Take rxe1's netdev down for a moment: its port must be reported DOWN with a warning.
    netdev = next(g["netdev"] for d in devices.rdma_devices()[0] if d["name"] == HOLDER_DEV
                  for g in d["ports"][0]["gids"] if g["netdev"])
    subprocess.run(["ip", "link", "set", netdev, "down"], check=True, timeout=30)
    try:
        res = subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", "--devices", "--no-ucx"],
                             capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["ip", "link", "set", netdev, "up"], check=True, timeout=30)
        _wait_active(HOLDER_DEV)  # the conformance cases after this one need the port back
    assert res.returncode == 1, res.stdout
    assert f"WARNING: {HOLDER_DEV} port 1: state DOWN" in res.stdout, res.stdout
