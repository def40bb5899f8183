"""Reader-side plan handling for the TCP transport: checks and splitting, as pure functions.

A plan becomes an (n, 5) int64 array (remote region, remote offset, local region, local offset,
nbytes). Every run is checked against the peer's region table and this side's regions (typed
errors naming the run), zero-length runs are dropped, and big plans are cut into byte-balanced
parts, one per parallel connection.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np

from pdxfer.layout import TransferPlan
from pdxfer.transport.base import OutOfRange, RegionUnknown

RUN_FIELDS = operator.attrgetter("remote_region", "remote_offset", "local_region", "local_offset", "nbytes")
_FIELD_GETTERS = tuple(operator.attrgetter(f) for f in
                       ("remote_region", "remote_offset", "local_region", "local_offset", "nbytes"))
SMALL_PLAN = 32  # up to this many runs, plain Python beats numpy's per-call overhead


def check_plan(plan: TransferPlan, remote_sizes: Sequence[int], local_sizes: Sequence[int],
               peer_id: str) -> np.ndarray:
    """The plan's runs as an (n, 5) int64 array, zero-length runs dropped, checked on both sides
    (the holder checks the remote side again; this catches mistakes early, naming the run)."""
    runs = plan.runs
    if not runs:
        return np.empty((0, 5), dtype=np.int64)
    if len(runs) <= SMALL_PLAN:
        return _check_small(runs, remote_sizes, local_sizes, peer_id)
    try:
        # One C-level pass per field: ~2x faster than going through a list of tuples.
        a = np.empty((len(runs), 5), dtype=np.int64)
        for j, field in enumerate(_FIELD_GETTERS):
            a[:, j] = np.fromiter(map(field, runs), dtype=np.int64, count=len(runs))
    except OverflowError as exc:
        raise OutOfRange(f"a run's region, offset or length does not fit in 63 bits: {exc}") from exc
    rr, ro, lr, lo, n = a.T
    rsizes = np.array(list(remote_sizes) + [0], dtype=np.int64)
    lsizes = np.array(list(local_sizes) + [0], dtype=np.int64)
    checks = (
        (n < 0, OutOfRange, "negative length {n}"),
        ((rr < 0) | (rr >= len(rsizes) - 1), RegionUnknown,
         "remote region {rr} not registered by " + peer_id + f" ({len(rsizes) - 1} regions)"),
        ((ro < 0) | (ro + n > rsizes[np.clip(rr, -1, len(rsizes) - 1)]), OutOfRange,
         "remote bytes [{ro}, {ro_end}) outside region {rr} ({rsize} bytes) of " + peer_id),
        ((lr < 0) | (lr >= len(lsizes) - 1), RegionUnknown,
         f"local region {{lr}} not registered ({len(lsizes) - 1} regions)"),
        ((lo < 0) | (lo + n > lsizes[np.clip(lr, -1, len(lsizes) - 1)]), OutOfRange,
         "local bytes [{lo}, {lo_end}) outside local region {lr} ({lsize} bytes)"),
    )
    for bad, exc, text in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            r = runs[i]
            rsize = remote_sizes[r.remote_region] if 0 <= r.remote_region < len(remote_sizes) else 0
            lsize = local_sizes[r.local_region] if 0 <= r.local_region < len(local_sizes) else 0
            raise exc(f"run {i}: " + text.format(n=r.nbytes, rr=r.remote_region, ro=r.remote_offset,
                                                 ro_end=r.remote_offset + r.nbytes, rsize=rsize,
                                                 lr=r.local_region, lo=r.local_offset,
                                                 lo_end=r.local_offset + r.nbytes, lsize=lsize))
    return a if (n > 0).all() else a[n > 0]


def _check_small(runs: Sequence, remote_sizes: Sequence[int], local_sizes: Sequence[int],
                 peer_id: str) -> np.ndarray:
    """Same checks as the vectorized path; for a few runs plain Python is ~10x cheaper."""
    out = []
    for i, r in enumerate(runs):
        rr, ro, lr, lo, n = RUN_FIELDS(r)
        if n < 0:
            raise OutOfRange(f"run {i}: negative length {n}")
        if not 0 <= rr < len(remote_sizes):
            raise RegionUnknown(f"run {i}: remote region {rr} not registered by {peer_id} "
                                f"({len(remote_sizes)} regions)")
        if ro < 0 or ro + n > remote_sizes[rr]:
            raise OutOfRange(f"run {i}: remote bytes [{ro}, {ro + n}) outside region {rr} "
                             f"({remote_sizes[rr]} bytes) of {peer_id}")
        if not 0 <= lr < len(local_sizes):
            raise RegionUnknown(f"run {i}: local region {lr} not registered ({len(local_sizes)} regions)")
        if lo < 0 or lo + n > local_sizes[lr]:
            raise OutOfRange(f"run {i}: local bytes [{lo}, {lo + n}) outside local region {lr} "
                             f"({local_sizes[lr]} bytes)")
        if n:
            out.append((rr, ro, lr, lo, n))
    try:
        return np.array(out, dtype=np.int64).reshape(-1, 5)
    except OverflowError as exc:
        raise OutOfRange(f"a run's offset or length does not fit in 63 bits: {exc}") from exc


def split_runs(a: np.ndarray, nconns: int, min_split_bytes: int) -> list[np.ndarray]:
    """Contiguous slices of the run array with about equal bytes each, at most ``nconns``; a run
    crossing a cut is split there, so one huge run is spread over all connections too. Plans
    under ``min_split_bytes`` stay whole (one request has the lowest latency)."""
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
