"""The rdma tier: boots the soft-RoCE guest once (tools/softroce) and runs the ``guest_*.py``
modules inside it, where NIXL/UCX READs cross between two rxe devices over rc_verbs.

Runs (never skips) as root on a machine with apt-get: the testbed installs what it needs. Skips
with the reason otherwise (a failure in CI). Takes 3-6 minutes on a 2-core host (QEMU TCG, no
KVM), up to 15 on a heavily loaded one: the guest scales its bounds by how much slower than the
host it measures itself (tests/rdma/conftest.py).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "softroce"))
import testbed

from .conftest import HOST_LOOP_ENV, speed_loop_s

GUEST_MODULES = ("tests/rdma/guest_devices.py", "tests/rdma/guest_conformance.py", "tests/rdma/guest_e2e.py")
GUEST_TIMEOUT = 1800.0
# NIXL's bundled libibverbs only searches /usr/lib64/libibverbs for providers and cannot load the
# distribution's rxe provider; preloading the distribution's libibverbs lets UCX's verbs calls
# resolve to a copy that can (docs/softroce.md).
GUEST_PRELUDE = "export LD_PRELOAD=$(ldconfig -p | awk '/libibverbs.so.1 .*x86-64/{print $NF; exit}')"


@pytest.fixture
def guest(softroce_packages) -> None:
    """The guest can boot here: root, and the testbed's packages installed (by the session fixture)."""
    if os.geteuid() != 0:
        pytest.skip("the soft-RoCE guest needs root (QEMU, apt-get for its packages)")
    if softroce_packages:
        pytest.skip(f"missing Debian packages {softroce_packages} and no apt-get to install them")


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
@pytest.mark.timeout(300)
def test_testbed_returns_the_commands_output_and_status(guest):
    out = io.StringIO()
    rc = testbed.run_in_guest("echo from-the-guest $(cat /sys/class/infiniband/rxe1/ports/1/state); exit 7",
                              REPO, Path(sys.prefix), timeout=240, sink=out)
    assert rc == 7, out.getvalue()[-3000:]
    assert "from-the-guest 4: ACTIVE" in out.getvalue()


@pytest.mark.rdma
@pytest.mark.timeout(120)
def test_testbed_kills_the_guest_when_its_time_is_up(guest):
    out = io.StringIO()
    t0 = time.monotonic()
    rc = testbed.run_in_guest("sleep 600", REPO, Path(sys.prefix), timeout=4, sink=out)
    assert rc == 124 and time.monotonic() - t0 < 30, out.getvalue()[-3000:]
    rundir = re.search(r"run directory kept: (\S+)", out.getvalue())
    assert rundir, out.getvalue()[-3000:]
    assert _processes_mentioning(rundir.group(1)) == [], "qemu survived the timeout"
    shutil.rmtree(rundir.group(1), ignore_errors=True)


@pytest.mark.rdma
@pytest.mark.timeout(GUEST_TIMEOUT + 120)
def test_rdma_tier_inside_the_softroce_guest(guest):
    modules = [m for m in GUEST_MODULES if (REPO / m).exists()]
    # The guest compares its own speed with this figure and scales its bounds by the ratio.
    cmd = (f"{GUEST_PRELUDE}\nexport {HOST_LOOP_ENV}={speed_loop_s():.4f}\n"
           f"exec python -m pytest {' '.join(modules)} -v -rA -p no:cacheprovider --durations=10")
    out = io.StringIO()
    t0 = time.monotonic()
    rc = testbed.run_in_guest(cmd, REPO, Path(sys.prefix), timeout=GUEST_TIMEOUT, sink=out)
    text = out.getvalue()
    log = testbed.cache_dir(REPO) / "last-rdma-tier.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(text)
    print(f"guest tier took {time.monotonic() - t0:.0f} s; full output in {log}")
    summary = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", text, re.MULTILINE)
    assert rc == 0, f"guest pytest rc {rc} ({summary}); tail of {log}:\n{text[-6000:]}"
    assert summary and "passed" in summary[-1], f"no pytest summary from the guest:\n{text[-3000:]}"
    for word in ("failed", "skipped", "error", "deselected"):
        assert word not in summary[-1], f"guest tier: {summary[-1]}\n{text[-6000:]}"
