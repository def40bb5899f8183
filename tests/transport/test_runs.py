"""The one run check (pdxfer/transport/runs.py): the vectorised path, the plain-Python path and
the holder's unsigned wire runs agree on every plan."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.transport.base import TransportError
from pdxfer.transport.runs import SMALL_PLAN, check_array, check_small_runs, fault, first_fault, plan_array

SIZES = [0, 1, 4096, 10_000]
coord = st.integers(-2, 4)
val = st.one_of(st.integers(-3, 10_010), st.sampled_from([4095, 4096, 10_000, 2**62, 2**63 - 1]))
run = st.builds(TransferRun, coord, val, coord, val, st.one_of(st.integers(-2, 5000), st.just(0)))


def outcome(fn):
    try:
        return ("ok", fn())
    except TransportError as exc:
        return (type(exc).__name__, str(exc))


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(run, min_size=1, max_size=SMALL_PLAN + 8))
def test_scalar_and_vectorised_checks_agree(runs):
    plan = TransferPlan(tuple(runs), len(runs))
    small = outcome(lambda: check_small_runs(plan.runs, SIZES, SIZES[::-1], "p"))
    big = outcome(lambda: check_array(plan_array(plan), SIZES, SIZES[::-1], "p").tolist())
    assert small[0] == big[0]
    if small[0] == "ok":
        assert [list(r) for r in small[1]] == big[1]
        assert all(r[4] > 0 for r in big[1]), "zero-length runs are dropped"
    else:
        assert small[1] == big[1], "both paths name the same run the same way"


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                     min_size=1, max_size=40))
def test_holder_wire_runs_use_the_same_rule(runs):
    arr = np.array(runs, dtype=np.uint64)
    want = next((i for i, (r, o, n) in enumerate(runs) if fault(r, o, n, SIZES) is not None), None)
    assert first_fault(arr[:, 0], arr[:, 1], arr[:, 2], SIZES) == want
