"""Splitting a checked run array (see ``pdxfer.transport.runs``) over the TCP transport's parallel
connections: byte-balanced parts, a pure function."""

from __future__ import annotations

import numpy as np

from pdxfer.transport.runs import SMALL_PLAN
from pdxfer.transport.tcp.wire import MAX_RUNS_PER_REQUEST


def split_runs(a: np.ndarray, nconns: int, min_split_bytes: int,
               max_runs: int = MAX_RUNS_PER_REQUEST) -> list[np.ndarray]:
    """Contiguous slices of the run array with about equal bytes each, at most ``nconns``; a run
    crossing a cut is split there, so one huge run is spread over all connections too. Plans
    under ``min_split_bytes`` stay whole (one request has the lowest latency). No slice has more
    than ``max_runs`` runs: holders refuse bigger requests."""
    return [p[i:i + max_runs] for p in _split_bytes(a, nconns, min_split_bytes)
            for i in range(0, len(p), max_runs)]


def _split_bytes(a: np.ndarray, nconns: int, min_split_bytes: int) -> list[np.ndarray]:
    if len(a) == 0:
        return []
    if nconns == 1 or (len(a) <= SMALL_PLAN and int(a[:, 4].sum()) < min_split_bytes):
        return [a]
    cum = np.cumsum(a[:, 4])
    total = int(cum[-1])
    if total < min_split_bytes:
        return [a]
    quota = -(-total // nconns)
    parts = []
    for k in range(nconns):
        lo, hi = k * quota, min(total, (k + 1) * quota)
        if lo >= hi:
            break
        j0 = int(np.searchsorted(cum, lo, side="right"))  # run holding byte lo
        j1 = int(np.searchsorted(cum, hi - 1, side="right"))  # run holding byte hi-1
        sub = a[j0:j1 + 1].copy()
        skip = lo - int(cum[j0] - a[j0, 4])
        sub[0, 1] += skip
        sub[0, 3] += skip
        sub[0, 4] -= skip
        sub[-1, 4] -= int(cum[j1]) - hi
        parts.append(sub)
    return parts
