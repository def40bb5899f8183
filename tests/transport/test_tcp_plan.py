"""TCP reader plan handling: checks name the bad run; splitting keeps every byte exactly once."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.transport.base import OutOfRange, RegionUnknown
from pdxfer.transport.runs import SMALL_PLAN, check_plan
from pdxfer.transport.tcp.plan import split_runs


def byte_map(parts: list[np.ndarray]) -> list[tuple[int, int, int, int]]:
    """(remote region, remote byte, local region, local byte) of every byte, in stream order."""
    out = []
    for p in parts:
        for rr, ro, lr, lo, n in p.tolist():
            out += [(rr, ro + k, lr, lo + k) for k in range(n)]
    return out


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=40), nconns=st.integers(1, 5),
       min_split=st.integers(0, 2000))
def test_split_keeps_every_byte_once_in_order(lengths, nconns, min_split):
    runs, ro, lo = [], 0, 10_000
    for i, n in enumerate(lengths):
        runs.append((i % 2, ro, 0, lo, n))
        ro += n + 7  # gaps: nothing may be merged or shifted across runs
        lo -= n + 3
    a = np.array([r for r in runs if r[4] > 0], dtype=np.int64).reshape(-1, 5)
    parts = split_runs(a, nconns, min_split)
    assert len(parts) <= nconns
    assert all(len(p) and (p[:, 4] > 0).all() for p in parts)
    assert byte_map(parts) == byte_map([a])
    total = int(a[:, 4].sum())
    if len(parts) > 1:
        sizes = [int(p[:, 4].sum()) for p in parts]
        assert max(sizes) - min(sizes) <= -(-total // nconns)


def plan(*runs: tuple[int, int, int, int, int]) -> TransferPlan:
    return TransferPlan(tuple(TransferRun(*r) for r in runs), len(runs))


@pytest.mark.parametrize("pad", [0, SMALL_PLAN + 5])  # the plain-Python and the vectorized path
def test_checks_name_the_bad_run_on_both_paths(pad):
    good = [(0, i * 8, 0, i * 8, 8) for i in range(pad)]
    cases = [((0, 395, 0, 0, 10), OutOfRange, "remote region 0 bytes [395, 405)"),
             ((2, 0, 0, 0, 1), RegionUnknown, "remote region 2"),
             ((0, 0, 1, 0, 1), RegionUnknown, "local region 1"),
             ((0, 0, 0, 1000, 1), OutOfRange, "local region 0 bytes [1000, 1001)"),
             ((0, 0, 0, 0, -1), OutOfRange, "negative length")]
    for bad, exc, text in cases:
        with pytest.raises(exc, match=rf"run {pad}: .*{re.escape(text)}"):
            check_plan(plan(*good, bad), [400, 50], [1000], "peer-x")
    out = check_plan(plan(*good, (1, 40, 0, 500, 10), (0, 0, 0, 0, 0)), [400, 50], [1000], "peer-x")
    assert out.tolist()[-1] == [1, 40, 0, 500, 10]  # zero-length run dropped


def test_split_never_exceeds_the_holders_run_cap():
    a = check_plan(plan(*[(0, 100 * i, 0, 100 * i, 10) for i in range(10)]), [10_000], [10_000], "p")
    parts = split_runs(a, 2, 1 << 30, max_runs=3)
    assert all(len(p) <= 3 for p in parts)
    assert np.array_equal(np.concatenate(parts), a)  # same runs, same order, nothing lost
