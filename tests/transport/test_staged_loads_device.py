"""Converting loads whose scatter runs on a device stream, between real processes and transports.

The reader's CPU KV uses the asynchronous stand-in (``PDXFER_DEVICE_STANDIN=async:<delay>``): its
stream is a thread that sleeps before every op, so the scatter out of staging lands well after it
was enqueued, as on a GPU. A load must be reported only once every scatter of it ran (the bytes
are exact the moment it is reported), a scatter the device failed fails the load, and one that
never completes fails it within its bound while its staging range stays out of use.
"""

from __future__ import annotations

import threading
import time

import pytest

import pdxfer.device as device
import pdxfer.device.native as native
from tests.transport.test_staged_loads import NTOK, TOKEN_BYTES, make_reader, start_holder  # noqa: F401 (fixtures)


@pytest.fixture
def standin(monkeypatch):
    """Make the reader's CPU memory use the asynchronous stand-in with ``delay`` s per op."""
    made = []

    def use(delay: float) -> None:
        monkeypatch.setattr(device, "_cache", {})
        monkeypatch.setenv("PDXFER_DEVICE_STANDIN", f"async:{delay}")
        made.append(device._cache)

    yield use
    for cache in made:
        for ops in cache.values():
            ops.close()


@pytest.fixture
def scatter_log(monkeypatch):
    """Times (monotonic) at which a stand-in scatter finished copying, on its stream thread."""
    done: list[float] = []
    real = native.scatter_tokens

    def logged(*a, **kw):
        real(*a, **kw)
        if threading.current_thread().name.startswith("pdxfer-standin-stream"):
            done.append(time.monotonic())

    monkeypatch.setattr(native, "scatter_tokens", logged)
    return done


def _wait_finished(reader, rid: str, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while rid not in reader.finished:
        assert time.monotonic() < deadline, f"load {rid} never finished"
        reader.finished |= reader.worker.get_finished()
        time.sleep(0.002)
    return time.monotonic()


@pytest.mark.parametrize("hb,lb", [(128, 32), (32, 128)])
def test_a_converting_load_is_reported_only_after_its_scatters_ran(kind, start_holder, make_reader, standin,
                                                                   scatter_log, hb, lb):
    standin(0.05)
    holder = start_holder(kind, hb)
    reader = make_reader(kind, lb, staging_mib=1)
    assert reader.worker._staging.ops.asynchronous
    start, end = 40, NTOK - 1
    assert (end - start) * TOKEN_BYTES > 3 << 20  # several pieces, each scattered before the next is read
    table = reader.post(holder, "late", start, end, seed=12)
    reported = _wait_finished(reader, "late")
    reader.check(table, start, end)  # exact the moment it is reported: nothing was still to land
    assert reader.worker.take_load_errors() == set()
    assert len(scatter_log) >= 3 and max(scatter_log) <= reported
    assert reader.worker.stats.loads_ok == 1
    assert reader.worker._staging.area.in_use == 0


def test_a_scatter_the_device_failed_fails_the_load_naming_it(kind, start_holder, make_reader, standin,
                                                              monkeypatch, caplog):
    standin(0.01)
    holder = start_holder(kind, 128)
    reader = make_reader(kind, 32)

    def broken(*_a, **_kw):
        raise RuntimeError("illegal memory access (planted)")

    monkeypatch.setattr(native, "scatter_tokens", broken)
    with caplog.at_level("WARNING", logger="pdxfer.vllm.worker"):
        table = reader.post(holder, "bad", 300, 700, seed=13)
        _wait_finished(reader, "bad")
    assert reader.worker.take_load_errors() == set(table[300 // 32:])  # vLLM recomputes them
    assert "illegal memory access (planted)" in caplog.text
    assert reader.worker.stats.loads_failed == 1
    assert reader.worker._staging.area.in_use == 0  # the failed scatter ended: its range is free


def test_a_scatter_that_never_completes_fails_the_load_in_bound_and_keeps_its_range(start_holder, make_reader,
                                                                                   standin, caplog):
    standin(2.0)  # far past the load's bound
    holder = start_holder("tcp", 128)
    reader = make_reader("tcp", 32, load_timeout_s=0.3, read_timeout_floor_s=0.1)
    worker = reader.worker
    worker._stop_bound_s = 0.6
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="pdxfer.vllm.worker"):
        table = reader.post(holder, "stuck", 300, 400, seed=14)
        _wait_finished(reader, "stuck", timeout=10.0)
    assert time.monotonic() - t0 < 1.8  # reported failed before the scatter ran
    assert worker.take_load_errors() == set(table[300 // 32:])
    assert "scatter from staging" in caplog.text and "has not completed" in caplog.text
    assert worker.connected_holders() == ["holder"]  # a kernel is no read: nothing to disconnect
    assert worker._staging.area.in_use > 0  # the scatter still reads its range
    deadline = time.monotonic() + 10.0
    while worker._staging.area.in_use:
        assert time.monotonic() < deadline, "the range of the completed scatter was never given back"
        worker.get_finished()
        time.sleep(0.05)
