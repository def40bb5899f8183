"""What a process holds open, for tests that compare it before and after many restarts: fds by
kind (``bench/proc_fds.py``: files, pipes, anon inodes, sockets by the process at the other end)
and this process's threads by name, without the ports and counters that threads carry in their
names (a holder's serving thread is named after the reader's port, an executor's by its index)."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter

from bench.proc_fds import fd_targets, kinds_by_group


def fd_kinds(**pids: int) -> dict[str, dict[str, int]]:
    """Per name: the fds of that process by kind; sockets name the peer by its name here
    (``socket:tcp->master``), or ``other`` for a peer not among ``pids``."""
    return kinds_by_group({name: fd_targets([pid]) for name, pid in pids.items()})


def thread_names() -> Counter[str]:
    return Counter(re.sub(r"[-_:.]?\d+", "", t.name) for t in threading.enumerate())


def census_with_master(master_pid: int) -> tuple[dict[str, int], dict[str, int]]:
    """(this process's fds by kind, the master's)."""
    k = fd_kinds(test=os.getpid(), master=master_pid)
    return k["test"], k["master"]


def without(kinds: dict[str, int], name: str) -> dict[str, int]:
    """``kinds`` but ``name`` (a kind a test judges apart)."""
    return {k: v for k, v in kinds.items() if k != name}
