"""What each process of `pdxfer launch` is doing while it starts: a phase per process, told from
the vLLM log lines we recognise, and the display of those phases (in place on a terminal, one plain
line per change otherwise). No raw log text reaches the screen: vLLM lines are long and change every
release, a phase name is short and stable.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass
from typing import TextIO


class Phase(enum.IntEnum):
    """Ordered: a process only moves forward, so the furthest phase seen wins."""

    STARTING = 0
    LOADING = 1
    WARMING = 2
    READY = 3
    EXITED = 4


LABELS = {
    Phase.STARTING: "starting",
    Phase.LOADING: "loading the model",
    Phase.WARMING: "compiling/warming up",
    Phase.READY: "ready",
}

# Furthest phase first. Each pattern is a message vLLM prints once on its way up (see the fixture
# tests/serve/data/vllm_cpu_startup.log for the lines these were taken from).
_MARKERS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (Phase.READY, re.compile(r"Application startup complete|Starting vLLM API server")),
    (Phase.WARMING, re.compile(
        r"CPU KV cache size|GPU KV cache size|GiB for KV cache|init engine \(profile|"
        r"torch\.compile takes|Compiling a graph|Capturing CUDA graph|[Ww]arming up")),
    (Phase.LOADING, re.compile(
        r"Starting to load model|Loading safetensors checkpoint|Loading weights took")),
)


def classify(log_text: str) -> Phase:
    """The furthest startup phase that the vLLM log text shows (STARTING when none is seen)."""
    best = Phase.STARTING
    for line in log_text.splitlines():
        for phase, pat in _MARKERS:
            if phase <= best:
                break
            if pat.search(line):
                best = phase
                break
    return best


@dataclass
class ProcStatus:
    """One process's row: its name, phase, exit code (EXITED) and log (shown when it exited)."""

    name: str
    phase: Phase = Phase.STARTING
    returncode: int | None = None
    log_path: str = ""

    def advance(self, phase: Phase) -> bool:
        """Move forward to ``phase`` (never back); True when the phase changed."""
        if phase > self.phase:
            self.phase = phase
            return True
        return False

    def text(self, room: int = 1000) -> str:
        """What the row says, in at most ``room`` characters: a long log path loses its start
        (the file name is what tells the logs apart; the full path is in launch's error)."""
        if self.phase is not Phase.EXITED:
            return LABELS[self.phase][:room]
        head = f"exited with code {self.returncode}, log "
        path = self.log_path
        if len(head) + len(path) > room:
            path = "..." + path[-max(room - len(head) - 3, 0):]
        return (head + path)[:room]


def render(rows: list[ProcStatus], elapsed: float, width: int = 80) -> list[str]:
    """One line per process, each at most ``width`` characters."""
    name_w = max((len(r.name) for r in rows), default=0)
    lines = []
    for r in rows:
        prefix = f"[{elapsed:4.0f}s] {r.name:<{name_w}}  "[:width]
        lines.append(prefix + r.text(width - len(prefix)))
    return lines


class StatusDisplay:
    """Shows the rows: redrawn in place on a terminal (cursor up, bounded to the rows we drew), one
    plain line per phase change anywhere else (logs, pipes: no ANSI)."""

    def __init__(self, out: TextIO | None = None, tty: bool | None = None, width: int = 80) -> None:
        self.out = out if out is not None else sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.width = width
        self._drawn = 0
        self._shown: dict[str, tuple[Phase, int | None]] = {}

    def update(self, rows: list[ProcStatus], elapsed: float) -> None:
        lines = render(rows, elapsed, self.width)
        if self.tty:
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            # \x1b[K clears what a longer earlier line left behind.
            self.out.write(up + "".join(f"{ln}\x1b[K\n" for ln in lines))
            self._drawn = len(lines)
        else:
            for row, ln in zip(rows, lines):
                key = (row.phase, row.returncode)
                if self._shown.get(row.name) != key:
                    self._shown[row.name] = key
                    self.out.write(ln + "\n")
        self.out.flush()


def observe(row: ProcStatus, ready: bool, returncode: int | None, log_tail: str) -> bool:
    """Move ``row`` on from what its process shows now; True when its phase changed."""
    if returncode is not None:
        row.returncode = returncode
        return row.advance(Phase.EXITED)
    if ready:
        return row.advance(Phase.READY)
    # READY from the log alone would claim more than /health said: stop at WARMING.
    return row.advance(min(classify(log_tail), Phase.WARMING))
