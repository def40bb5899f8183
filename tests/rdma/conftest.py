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
import sys
from pathlib import Path

import pytest

IN_GUEST = os.environ.get("PDXFER_SOFTROCE") == "1"
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
    # reader learns of the death only when its RC retries run out. UCX's defaults (1 s x 7 retries,
    # with backoff) leave that past the suite's 10 s bound; these make it ~1-2 s.
    os.environ.setdefault("UCX_RC_TIMEOUT", "200ms")
    os.environ.setdefault("UCX_RC_RETRY_COUNT", "3")

HOLDER_PREFIX = ["env", f"UCX_NET_DEVICES={HOLDER_DEV}:1"]


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if Path(str(item.fspath)).name.startswith("guest_") and not IN_GUEST:
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
