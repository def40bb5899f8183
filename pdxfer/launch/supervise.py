"""Keeping a launched fleet serving: a process of it (an instance, the proxy, the in-memory master)
that exits is started again, after a backoff and up to a limit, while the others go on serving;
each death, restart and return is told in one line naming the process, its exit code and its log.

A restarted process gets its own argv back, on the same ports, so the proxy's backend list, the
instances' master address and the master's node records stay valid; its log continues the old
one. A process that died ``max_restarts`` times within ``window_s`` stays down: the fleet goes on
without it unless it was the proxy, without which nothing serves (``fatal``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pdxfer.common.procs import http_ok

if TYPE_CHECKING:
    from pdxfer.launch.fleet import Component, Stack


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts of one process within window_s before it stays down
    window_s: float = 600.0
    backoff_s: float = 1.0  # the first restart's wait; doubled for each restart in the window
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"a restart policy needs max_restarts >= 0, window_s > 0 and "
                             f"0 <= backoff_s <= max_backoff_s, got {self}")


@dataclass
class _Watch:
    state: str = "up"  # up | waiting (dead, restart scheduled) | starting | down (given up)
    restarts: deque = field(default_factory=deque)  # monotonic times of restarts in the window
    restart_at: float = 0.0
    died_at: float = 0.0


class Supervisor:
    """Call :meth:`check` periodically (the launcher's main loop): it never blocks for long."""

    def __init__(self, stack: Stack, policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic,
                 ready: Callable[[str], bool] = http_ok) -> None:
        self.stack = stack
        self.policy = policy
        self._clock = clock
        self._ready = ready
        self._watch = {c.name: _Watch() for c in stack.components}
        self.fatal: str | None = None  # why the fleet cannot serve any more

    def state(self, name: str) -> str:
        return self._watch[name].state

    def check(self) -> list[str]:
        """One pass over every process; the lines to tell the operator."""
        now = self._clock()
        out: list[str] = []
        for comp in self.stack.components:
            w = self._watch[comp.name]
            if w.state in ("up", "starting") and not comp.proc.alive():
                out.append(self._died(comp, w, now))
            elif w.state == "waiting" and now >= w.restart_at:
                out.append(self._restart(comp, w, now))
            elif w.state == "starting" and self._serves(comp):
                w.state = "up"
                comp.ready = True
                out.append(f"{comp.name} is back after {now - w.died_at:.1f} s (pid {comp.proc.pid})")
        return out

    def _serves(self, comp: Component) -> bool:
        url = comp.serving_url or comp.ready_url
        return url is None or self._ready(url)

    def _died(self, comp: Component, w: _Watch, now: float) -> str:
        w.died_at = now
        comp.ready = False
        while w.restarts and now - w.restarts[0] > self.policy.window_s:
            w.restarts.popleft()
        what = f"{comp.name} (pid {comp.proc.pid}) exited with {comp.proc.returncode}; log {comp.proc.log_path}"
        if len(w.restarts) >= self.policy.max_restarts:
            w.state = "down"
            if comp.name == "proxy":
                self.fatal = f"the proxy exited {len(w.restarts) + 1} times within {self.policy.window_s:.0f} s"
            return (f"{what}; restarted {len(w.restarts)} time(s) within {self.policy.window_s:.0f} s: "
                    "not restarting it, the rest go on")
        wait = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** len(w.restarts))
        w.state, w.restart_at = "waiting", now + wait
        return f"{what}; restarting it in {wait:.0f} s (restart {len(w.restarts) + 1} of {self.policy.max_restarts})"

    def _restart(self, comp: Component, w: _Watch, now: float) -> str:
        try:
            comp.proc = comp.proc.respawn(comp.restart_argv)
        except OSError as exc:  # the binary or the log folder went away: count it as a death
            w.restarts.append(now)
            w.state = "up"
            return f"{comp.name} could not be started again: {exc}"
        w.restarts.append(now)
        w.state = "starting"
        return f"{comp.name} restarted (pid {comp.proc.pid}), waiting for it to answer"
