"""PASS / FAIL / SKIP lines, a summary, and the results file that keeps everything printed.

Lines reach the file as they are printed, so a run killed by its time limit still leaves them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


class Report:
    """Prints each line as it comes (a long run shows progress) and keeps it for the file."""

    def __init__(self, path: Path, budget_s: float = 0.0) -> None:
        self.path = path
        self.budget_s = budget_s  # 0: no limit
        self.lines: list[str] = []
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self._t0 = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def line(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)
        self._file.write(text + "\n")
        self._file.flush()

    def info(self, text: str) -> None:
        self.line(f"  {text}")

    def _result(self, kind: str, name: str, detail: str) -> None:
        self.counts[kind] += 1
        self.line(f"{kind} {name}" + (f": {detail}" if detail else ""))

    def passed(self, name: str, detail: str = "") -> None:
        self._result("PASS", name, detail)

    def failed(self, name: str, detail: str) -> None:
        self._result("FAIL", name, detail)

    def skipped(self, name: str, why: str) -> None:
        self._result("SKIP", name, why)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        (self.passed if ok else self.failed)(name, detail)
        return ok

    def out_of_time(self, what: str) -> bool:
        """True (and a FAIL line for ``what``) once the run's time budget is spent: a check that
        never ran must not look like a pass, and the caller's hard time limit must not be hit."""
        if self.budget_s and time.monotonic() - self._t0 > self.budget_s:
            self.failed(what, f"not run: the check's time budget of {self.budget_s:.0f} s is spent")
            return True
        return False

    @property
    def ok(self) -> bool:
        return self.counts["FAIL"] == 0 and self.counts["PASS"] > 0

    def summary(self) -> str:
        c = self.counts
        verdict = "OK" if self.ok else "FAILED"
        text = (f"gpu check {verdict}: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP "
                f"in {time.monotonic() - self._t0:.1f} s")
        self.line(text)
        return text

    def close(self) -> None:
        self._file.close()
        print(f"results written to {self.path}", file=sys.stderr, flush=True)
