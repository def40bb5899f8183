"""pdxfer-probe --devices on whatever host runs it (no guest needed), checked against pyverbs
itself: on a host without RDMA (this one: pyverbs raises PyverbsRDMAError) a clean answer with no
devices and the reason; on a host with devices, every device listed. guest_devices.py runs the
two probe tests in the soft-RoCE guest too, so both kinds of host are covered on every run. Also
the warning rules on device reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdxfer.probe import devices
from tests.transport.conftest import REPO, child_env

# Asked with the system Python and Debian's pyverbs directly, not through the probe's own loader.
_ASK_PYVERBS = """
import json
from pyverbs.device import get_device_list
try:
    devs = get_device_list()
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"devices": sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs)}))
"""


def _sysfs_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def pyverbs_answer() -> dict:
    """{"devices": [names]} or {"error": exception name, "message": ...}: what pyverbs says here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    res = subprocess.run(["/usr/bin/python3", "-c", _ASK_PYVERBS], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, f"asking pyverbs with /usr/bin/python3 failed: {res.stderr[-2000:]}"
    ans = json.loads(res.stdout)
    if "devices" in ans:  # pyverbs and the kernel must agree, or this oracle is itself wrong
        assert ans["devices"] == _sysfs_devices(), (ans, _sysfs_devices())
    else:
        assert _sysfs_devices() == [], f"pyverbs raised {ans} while sysfs lists {_sysfs_devices()}"
    return ans


@pytest.fixture(scope="module")
def pyverbs(softroce_packages) -> dict:
    """pyverbs' own answer on this host (asked once: in the guest a Python start costs seconds);
    it must be installed (the session fixture installs the testbed's packages first, so no other
    test has to run before)."""
    if "python3-pyverbs" in softroce_packages:
        pytest.skip("python3-pyverbs is not installed and cannot be here (needs root and apt-get)")
    return pyverbs_answer()


def _probe(*args: str) -> subprocess.CompletedProcess:
    # UCX's view is not what these check (guest_devices.py does), and ucx_info costs seconds in the guest.
    return subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", "--devices", "--no-ucx", *args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)


def test_probe_devices_json_gives_a_clean_answer_on_this_host(pyverbs):
    res = _probe("--json")
    assert "Traceback" not in res.stderr, res.stderr
    rep = json.loads(res.stdout)
    if "error" in pyverbs:
        assert res.returncode == 0, res.stderr
        assert rep["devices"] == [], rep
        assert f"{pyverbs['error']}: {pyverbs['message']}" in rep.get("reason", ""), (pyverbs, rep.get("reason"))
    elif not pyverbs["devices"]:
        assert res.returncode == 0 and rep["devices"] == [] and rep["reason"], rep
    else:
        assert "reason" not in rep, rep
        assert sorted(d["name"] for d in rep["devices"]) == pyverbs["devices"], (pyverbs, rep["devices"])
        for d in rep["devices"]:
            assert "error" not in d and d["ports"], d
        assert res.returncode == (1 if rep["warnings"] else 0), (res.returncode, rep["warnings"])


def test_probe_devices_text_is_one_rdma_line_then_topology_without_rdma(pyverbs):
    res = _probe()
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stdout.splitlines()
    if "error" in pyverbs or not pyverbs["devices"]:
        assert res.returncode == 0 and res.stderr == "", res.stderr
        first, *rest = lines
        assert "no RDMA devices" in first and rest[0].startswith("GPU <-> NIC topology"), res.stdout
        assert "error" not in pyverbs or pyverbs["error"] in first, (pyverbs, first)
    else:
        # A block per device (its name alone on a line, then its ports), no "no RDMA devices"
        # line, and exit 1 exactly when a warning is printed.
        assert not any("no RDMA devices" in ln for ln in lines), res.stdout
        for name in pyverbs["devices"]:
            assert name in lines, f"{name} is not listed:\n{res.stdout}"
            assert lines[lines.index(name) + 1].startswith("  port 1: "), res.stdout
        warned = any(ln.startswith("WARNING: ") for ln in lines)
        assert res.returncode == (1 if warned else 0), res.stdout


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
