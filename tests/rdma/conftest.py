"""The rdma tier: soft-RoCE inside a QEMU guest (tools/softroce).

Two kinds of modules live here:
* ``test_*.py`` run on the host: they boot the guest through the testbed and run the ``guest_*.py``
  modules inside it with pytest (one boot for the whole tier).
* ``guest_*.py`` run inside the guest, where rxe0 (192.168.77.1) and rxe1 (192.168.77.2) exist.
  pytest does not collect them by name; the host test passes them explicitly.

In the guest, the reader (this pytest process) owns rxe0 and every holder process owns rxe1, so
each READ crosses the veth pair between two RDMA devices.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_GUEST = os.environ.get("PDXFER_SOFTROCE") == "1"
# The host test passes how long speed_loop_s() took on the host just before the boot.
HOST_LOOP_ENV = "PDXFER_HOST_LOOP_S"
READER_DEV = os.environ.get("SOFTROCE_DEV0", "rxe0")
HOLDER_DEV = os.environ.get("SOFTROCE_DEV1", "rxe1")
# UCX transports that would mean the bytes did not cross an RDMA device.
NOT_RDMA = ("tcp", "cma", "sysv", "posix", "xpmem", "knem")

if IN_GUEST:
    # NIXL's UCX must see the ib module (the host-only UCX_MODULES=^ib default would hide rxe).
    os.environ["UCX_MODULES"] = "all"
    os.environ.setdefault("UCX_TLS", "rc_verbs,ud_verbs,self")
    os.environ["UCX_NET_DEVICES"] = f"{READER_DEV}:1"
    # A dead holder's QPs are gone and rxe (like RoCE NICs) drops packets for them silently: the
    # reader learns of the death only when its RC retries run out, after (retries + 1) x timeout.
    # The same sum is how long a live holder may go unheard before it is declared dead, so it is
    # set well above a network stall (test_live_holder_survives_a_network_stall) and well below
    # the guest's death bound. 200 ms x 3 declared a live holder dead in a loaded CI guest;
    # these: a dead one noticed ~8 s after the kill, a live one kept through a 2 s stall (docs/softroce.md).
    os.environ.setdefault("UCX_RC_TIMEOUT", "1s")
    os.environ.setdefault("UCX_RC_RETRY_COUNT", "6")

HOLDER_PREFIX = ["env", f"UCX_NET_DEVICES={HOLDER_DEV}:1"]


def speed_loop_s() -> float:
    """Seconds a fixed pure-Python loop takes here (best of 3): the guest compares its own with the
    host's to learn how much slower it runs."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        acc = 0
        for i in range(300_000):
            acc = (acc + i * i) % 1_000_003
        best = min(best, time.perf_counter() - t0)
    return best


def _guest_slowdown() -> float:
    """How many times slower than the host this guest runs right now (at least 1). QEMU TCG
    emulates the CPU, and on a loaded host the guest gets a share of it: the suite's bounds, written
    for the host, are scaled by this, so a slow but correct guest does not fail on a fixed number
    (a 128 MiB READ over rxe took over 20 s with the host's load average at 12)."""
    host = float(os.environ.get(HOST_LOOP_ENV) or 0)
    if host <= 0:
        return 10.0  # run by hand without the host's figure: TCG alone costs about that
    return max(1.0, speed_loop_s() / host)


SLOWDOWN = _guest_slowdown() if IN_GUEST else 1.0
# The loop measures the CPU only; starting a process also reads hundreds of files over 9p, which
# costs the host's CPU as well (a torch-importing holder took over 180 s at load average 12). The
# bounds below only stop a hang, so each has a generous floor and grows with the slowdown.
GUEST_TEST_TIMEOUT_S = 300 * max(2.0, SLOWDOWN)  # per test (pyproject's 300 s is the host's)
START_S = max(300.0, 60 * SLOWDOWN)  # a helper process (Python + NIXL over 9p) starting
READ_WAIT_S = max(120.0, 20 * SLOWDOWN)  # the transport suite's 20 s read bound, in the guest
DEATH_BOUND_S = max(30.0, 10 * SLOWDOWN)  # ... and its 10 s bound on noticing a killed holder


def guest_bound(seconds: float) -> float:
    """A bound chosen by hand for the guest on an idle host, scaled when the guest runs slower."""
    return seconds * max(1.0, SLOWDOWN / 2)


def pytest_report_header(config) -> str | None:
    if IN_GUEST:
        return f"soft-RoCE guest: {SLOWDOWN:.1f}x slower than the host; bounds scaled by that"
    return None


@pytest.fixture(autouse=True)
def _guest_bounds(monkeypatch):
    """In the guest, the transport suite's bounds (written for the host) replaced by the guest's."""
    if IN_GUEST:
        from tests.transport import test_conformance

        monkeypatch.setattr(test_conformance, "WAIT", READ_WAIT_S)
        monkeypatch.setattr(test_conformance, "DEATH_BOUND_S", DEATH_BOUND_S)


@pytest.fixture(scope="session")
def softroce_packages() -> list[str]:
    """The testbed's Debian packages, installed (root + apt-get) before the first rdma test that
    needs one, whichever runs first; returns what is still missing. Without this a fresh machine
    failed the host probe test (no pyverbs yet) and passed on the rerun, once the guest test had
    installed them."""
    sys.path.insert(0, str(REPO / "tools" / "softroce"))
    import testbed

    missing = testbed.missing_packages()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        testbed.ensure_packages(install=True)
        missing = testbed.missing_packages()
    return missing


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if not Path(str(item.fspath)).name.startswith("guest_"):
            continue
        if IN_GUEST:
            item.add_marker(pytest.mark.timeout(GUEST_TEST_TIMEOUT_S))
        else:
            # Only when named by hand on the host: test_softroce.py runs them inside the guest.
            item.add_marker(pytest.mark.may_skip(reason="runs only inside the soft-RoCE guest"))
            item.add_marker(pytest.mark.skip(reason="runs only inside the soft-RoCE guest (tests/rdma/test_softroce.py)"))


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    # With UCX's ib module loaded, every process that created a UCX context segfaults in a library
    # destructor at exit (rc 139; measured in the guest with and without the system libnl preloaded).
    # All reports are written by now; leave before the destructors run so the status is pytest's.
    if IN_GUEST and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def ucx_lane_lines(text: str) -> list[str]:
    """Endpoint configuration lines ('self/intra-node/inter-node cfg#N rma(...) ...') that UCX logs
    at UCX_LOG_LEVEL=info."""
    return [ln.split("UCX  INFO", 1)[-1].strip() for ln in text.splitlines()
            if re.search(r"(self|inter-node|intra-node) cfg#\d+", ln)]
