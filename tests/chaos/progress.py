"""What a chaos run has logged so far, read while it runs: the harness ends each phase of a run on
events (the work a test needs was done, every holder is back after the faults, every holder is
drained) instead of fixed waits, each wait still with a bound.

  p = Progress(logdir, cfg); p.poll()  # new complete lines of every process's JSON-lines log
  p.report()                           # the checker's report over what was logged so far
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Any

from tests.chaos import checker
from tests.chaos.common import ChaosConfig


class Progress:
    def __init__(self, logdir: str, cfg: ChaosConfig) -> None:
        self.logdir, self.cfg = logdir, cfg
        self.recs: list[dict[str, Any]] = []
        self._offsets: dict[str, int] = {}
        self._report: dict[str, Any] | None = None
        self.report_s = 0.0  # what the last report() cost: callers poll no faster than that allows

    def poll(self) -> list[dict[str, Any]]:
        """Records written since the last poll (whole lines only: a line being written waits)."""
        new: list[dict[str, Any]] = []
        for path in sorted(glob.glob(os.path.join(self.logdir, "*.jsonl"))):
            off = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(off)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[path] = off + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a SIGKILLed process's last line may be cut short
        if new:
            self.recs.extend(new)
            self._report = None
        return new

    def report(self) -> dict[str, Any]:
        """The checker over the records so far (cached until the next poll brings more)."""
        if self._report is None:
            t0 = time.monotonic()
            self._report = checker.check_records(self.recs, self.cfg, None, repull=False)
            self.report_s = time.monotonic() - t0
        return self._report
