"""pdxfer-probe --devices on this host (runs everywhere, no guest): a clean answer without RDMA,
and the warning rules on device reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdxfer.probe import devices
from tests.transport.conftest import REPO, child_env


def _has_rdma() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


@pytest.fixture
def pyverbs(softroce_packages) -> None:
    """These checks are of pyverbs' answer on a host without RDMA: it must be installed (the
    session fixture installs the testbed's packages first, so no other test has to run before)."""
    if "python3-pyverbs" in softroce_packages:
        pytest.skip("python3-pyverbs is not installed and cannot be here (needs root and apt-get)")


def test_probe_devices_json_gives_a_clean_answer_on_this_host(pyverbs):
    res = subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", "--devices", "--json"], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    rep = json.loads(res.stdout)
    if _has_rdma():
        assert rep["devices"], rep
    else:
        assert res.returncode == 0
        assert rep["devices"] == [] and rep["reason"], rep


def test_probe_devices_text_is_one_rdma_line_then_topology_without_rdma(pyverbs):
    if _has_rdma():
        return  # a host with devices prints a device table instead; covered in the guest
    res = subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", "--devices"], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stderr == ""
    first, *rest = res.stdout.splitlines()
    assert "no RDMA devices" in first and rest[0].startswith("GPU <-> NIC topology")


def _port(state="ACTIVE", mtu=4096, gtypes=("RoCE v2",)) -> dict:
    gids = [{"index": i, "gid": "x", "type": t, "ipv4": None, "netdev": "eth0"} for i, t in enumerate(gtypes)]
    return {"port": 1, "state": state, "link_layer": "Ethernet", "active_mtu": mtu, "max_mtu": 4096, "gids": gids}


def test_warnings_name_the_device_and_the_problem():
    ok = [{"name": "a", "ports": [_port()]}, {"name": "b", "ports": [_port()]}]
    assert devices.warnings_for(ok) == []
    down = devices.warnings_for([{"name": "a", "ports": [_port(state="DOWN")]}])
    assert len(down) == 1 and down[0].startswith("a port 1: state DOWN")
    v1 = devices.warnings_for([{"name": "a", "ports": [_port(gtypes=("RoCE v1",))]}])
    assert len(v1) == 1 and "no RoCE v2 GID" in v1[0]
    mtu = devices.warnings_for([{"name": "a", "ports": [_port(mtu=1024)]}, {"name": "b", "ports": [_port()]}])
    assert len(mtu) == 1 and "MTU differs" in mtu[0] and "a port 1 1024" in mtu[0]
