"""Reading a child process's announcement lines with a bound (no pytest: the GPU check uses it)."""

from __future__ import annotations

import select
import subprocess
import time


def read_prefixed_line(proc: subprocess.Popen, prefix: str, timeout: float, what: str = "") -> str:
    """Next stdout line of ``proc`` starting with ``prefix``; AssertionError after ``timeout``
    seconds, or when the process exits first (with the end of its stderr)."""
    who = what or f"pid {proc.pid}"
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {prefix!r} line from {who} within {timeout:.0f} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"{who} exited (rc {proc.wait(5)}) before {prefix!r}: {err.strip()[-2000:]}")
        if line.startswith(prefix):
            return line.rstrip("\n")
