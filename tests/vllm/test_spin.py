"""pdxfer.contracts.spin: the opt-in that makes vLLM's shm_broadcast busy-wait sleep, not yield."""

from __future__ import annotations

import time

import pytest

from pdxfer.contracts import spin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def restore():
    saved = shm_broadcast.sched_yield, getattr(shm_broadcast, "_pdxfer_spin_sleep_s", None)
    yield
    shm_broadcast.sched_yield = saved[0]
    shm_broadcast._pdxfer_spin_sleep_s = saved[1]


def test_unset_leaves_vllm_alone(restore):
    before = shm_broadcast.sched_yield
    assert spin.apply_from_env({}) is None
    assert spin.apply_from_env({spin.ENV: " "}) is None
    assert shm_broadcast.sched_yield is before


def test_set_makes_the_spin_condition_sleep(restore):
    assert spin.apply_from_env({spin.ENV: "2000"}) == pytest.approx(0.002)
    assert spin.apply_from_env({spin.ENV: "2000"}) == pytest.approx(0.002)  # idempotent
    # The name SpinCondition.wait calls while busy-looping now sleeps instead of sched_yield().
    t0 = time.monotonic()
    for _ in range(5):
        shm_broadcast.sched_yield()
    assert time.monotonic() - t0 >= 5 * 0.002 * 0.9


@pytest.mark.parametrize("bad", ["0", "-5", "1e9", "fast"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        spin.spin_sleep_s({spin.ENV: bad})
