"""The rdma tier's host tests of the session's one soft-RoCE guest (tools/softroce; the guest_*.py
tests run in it too, each reported as its own test, tests/rdma/conftest.py): the testbed's command
output and status, the guest tests' run as a whole, and the kill of a guest whose time is up.

Runs (never skips) as root on a machine with apt-get: the testbed installs what it needs. Skips
with the reason otherwise (a failure in CI). The whole tier takes 4-5 minutes on a 2-core host
(QEMU TCG, no KVM), one boot included: the guest scales its bounds by how much slower than the
host it measures itself, and the host bounds the guest's run by that too (tests/rdma/conftest.py).
"""

from __future__ import annotations

import io
import re
import shutil
import time
from pathlib import Path

import pytest

from .conftest import GUEST_TIER_S, GuestSession

# The echo command's bound, boot included when it is the session's first guest command: the
# whole test took 10 s with its own boot here (2 busy cores); 12x that.
ECHO_S = 120.0


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.rdma
@pytest.mark.timeout(ECHO_S + 60)
def test_testbed_returns_the_commands_output_and_status(guest: GuestSession):
    out = io.StringIO()
    rc = guest.run("echo from-the-guest $(cat /sys/class/infiniband/rxe1/ports/1/state); exit 7",
                   timeout=ECHO_S, sink=out)
    assert rc == 7, out.getvalue()[-3000:]
    assert "from-the-guest 4: ACTIVE" in out.getvalue()


@pytest.mark.rdma
@pytest.mark.timeout(GUEST_TIER_S + 120)
def test_rdma_tier_inside_the_softroce_guest(guest: GuestSession):
    """The guest tests' one run as a whole (each guest test also passes or fails on its own, as a
    GuestCase): every one passed, none skipped or deselected, the guest's pytest exited 0."""
    tier = guest.tier_run()
    rc = tier.finish()
    text = tier.out.getvalue()
    print(f"guest tier took {time.monotonic() - tier.t0:.0f} s; full output in {guest.log_path}")
    summary = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", text, re.MULTILINE)
    assert rc == 0, f"guest pytest rc {rc} ({summary}); tail of {guest.log_path}:\n{text[-6000:]}"
    assert summary and "passed" in summary[-1], f"no pytest summary from the guest:\n{text[-3000:]}"
    for word in ("failed", "skipped", "error", "deselected"):
        assert word not in summary[-1], f"guest tier: {summary[-1]}\n{text[-6000:]}"


# Last in this module: it kills the session's guest (a later guest command would boot another).
@pytest.mark.rdma
@pytest.mark.timeout(120)
def test_testbed_kills_the_guest_when_its_time_is_up(guest: GuestSession):
    out = io.StringIO()
    t0 = time.monotonic()
    rc = guest.run("sleep 600", timeout=4, sink=out)
    assert rc == 124 and time.monotonic() - t0 < 30, out.getvalue()[-3000:]
    rundir = re.search(r"run directory kept: (\S+)", out.getvalue())
    assert rundir, out.getvalue()[-3000:]
    assert _processes_mentioning(rundir.group(1)) == [], "qemu survived the timeout"
    shutil.rmtree(rundir.group(1), ignore_errors=True)
