"""Where a decode's time-to-first-token goes, phase by phase, for vLLM's stats and /metrics.

Phases of one load, in order (each a Prometheus histogram ``vllm:pdxfer_phase_<name>_seconds``;
what each covers is ``PHASE_MEANINGS``, which docs/metrics.md shows),
then vLLM schedules the request in its next step and computes the one token (not measured here:
the time-to-first-token minus these phases).
"""

from __future__ import annotations

import threading

PHASES = ("lookup", "publish_wait", "post", "read", "release")
PHASE_MEANINGS = {
    "lookup": "the scheduler's lookup-and-lock round trip to the master",
    "publish_wait": "a decode waiting for chunks its prefill's hint said were being published",
    "post": "from the lookup to the worker posting the reads (waiting for the step that carries the "
            "load's metadata to the worker)",
    "read": "from posting the reads to every read done (as the worker's step-end poll saw it)",
    "release": "from the reads done to the master confirming the lock held (the load is valid)",
}
STATS_PREFIX = "phase_"  # key of a phase's sample list in the connector stats: phase_<name>_s


def stats_key(phase: str) -> str:
    return f"{STATS_PREFIX}{phase}_s"


class PhaseTimes:
    """Samples per phase since the last ``take``; thread-safe (releases land on a pool thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {}

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; known: {PHASES}")
        with self._lock:
            self._samples.setdefault(phase, []).append(max(seconds, 0.0))

    def take(self) -> dict[str, list[float]]:
        """The samples as connector-stats lists (``phase_<name>_s``), cleared."""
        with self._lock:
            out, self._samples = self._samples, {}
        return {stats_key(p): v for p, v in out.items() if v}
