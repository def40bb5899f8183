"""Target-side progress for a NIXL agent without a busy-spinning thread.

With NIXL's own progress thread enabled, bandwidth drops 2-4x on a 2-core host (measured); with
it disabled, nothing progresses the holder's UCX worker, and a reader's first READ (the UCX
wire-up) hangs until the holder happens to call into NIXL. vLLM's NixlConnector solves this by
spinning a core at 100 %.

This thread calls ``get_new_notifs()`` (which progresses the worker) adaptively instead:
* hot: every ``busy_interval`` seconds for ``hot_window`` seconds after any notification arrived.
  Readers send a notification at connect, before a READ that follows a quiet spell, and every
  ``hot_window / 2`` while they keep reading or waiting, so the holder is hot exactly while somebody
  is wiring up or reading (the UCX TCP transport needs target progress per READ; shared-memory CMA
  and RDMA READs do not after wire-up). READs themselves carry no notification: measured here, a
  completion notification makes every READ wait for the holder's next poll (~0.6 ms for 32 KiB).
* idle: the interval doubles up to ``idle_interval`` (50 wake-ups a second, under 1 % of a core
  measured). A UCX wire-up needs a few holder polls before the hello notification can travel, so
  each of those steps waits up to one idle interval (connect to an idle holder: ~0.1 s).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class TargetProgress:
    def __init__(self, agent: Any, lock: threading.Lock, busy_interval: float = 0.0005,
                 idle_interval: float = 0.02, hot_window: float = 2.0, name: str = "pdxfer-nixl-progress"):
        if not 0 < busy_interval <= idle_interval:
            raise ValueError(f"need 0 < busy_interval ({busy_interval}) <= idle_interval ({idle_interval})")
        self._agent = agent
        self._lock = lock
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self.hot_window = hot_window
        self._stop = threading.Event()
        self._last_activity = time.monotonic()  # start hot: a reader may connect right after export
        self.polls = 0
        self.notifs = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Go hot now (e.g. this side just exported metadata and expects readers)."""
        self._last_activity = time.monotonic()

    def _run(self) -> None:
        interval = self.busy_interval
        while not self._stop.is_set():
            agent = self._agent
            if agent is None:
                return
            try:
                with self._lock:
                    new = agent.get_new_notifs()
                self.polls += 1
            except Exception as exc:  # a dead reader's endpoint must not stop serving the others
                log.debug("NIXL progress poll failed: %r", exc)
                new = None
            now = time.monotonic()
            if new:
                self.notifs += sum(len(v) for v in new.values())
                self._last_activity = now
            if now - self._last_activity < self.hot_window:
                interval = self.busy_interval
            else:
                interval = min(interval * 2, self.idle_interval)
            self._stop.wait(interval)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            # This object and its thread reference each other; dropping the agent here keeps the
            # NIXL agent from being destroyed later inside a garbage-collector run (seen: abort).
            self._agent = None
