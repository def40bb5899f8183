"""Conformance suite: every transport in pdxfer.transport.KINDS, holder and reader in separate
processes, real sockets/agents, real kills. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import (
    MetadataError,
    OutOfRange,
    PeerDied,
    PeerUnreachable,
    ReadState,
    RegionUnknown,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)

from .conftest import HOLDER_SIZES, MiB, freeze, read_line, spawn_reader, stop

WAIT = 20.0  # generous bound for one read on a loaded 2-core box; still a bound
DEATH_BOUND_S = 10.0  # a holder killed under a read is a typed error within this


def remote_sizes() -> dict[int, int]:
    return dict(enumerate(HOLDER_SIZES))


def read_and_check(reader, peer: str, plan: TransferPlan, seed: int = 0) -> None:
    """Read ``plan`` and check every byte against the pattern of the holder's ``seed``."""
    reader.dst[:] = 0
    assert reader.t.read(peer, plan).wait(WAIT) is ReadState.DONE
    assert mismatches(plan, {0: reader.dst}, remote_sizes(), seed=seed) == []
    assert reader.guards_intact(), "bytes landed outside the destination region"


def expect_error(fn, exc_type: type) -> TransportError:
    """Run ``fn`` (a read and its wait); the typed error may come from either call."""
    with pytest.raises(exc_type) as info:
        fn()
    return info.value


def test_single_run_exact(kind, shared):
    reader, peer = shared.reader(kind)
    # Odd offsets and length: nothing may rely on alignment.
    plan = TransferPlan((TransferRun(0, 12345, 0, 777, 16 * MiB + 3),), 1)
    read_and_check(reader, peer, plan)
    untouched = np.concatenate([reader.dst[:777], reader.dst[777 + 16 * MiB + 3:]])
    assert not untouched.any(), "bytes outside the run were written"


@pytest.mark.parametrize("block", [16 << 10, 32 << 10])
def test_4096_scattered_runs_exact(kind, shared, block):
    reader, peer = shared.reader(kind)
    plan = scattered_plan(block, 4096, HOLDER_SIZES[0], reader.dst.nbytes, seed=block)
    assert len(plan) == 4096
    read_and_check(reader, peer, plan)


def test_runs_from_two_regions_in_one_plan(kind, shared):
    reader, peer = shared.reader(kind)
    small = HOLDER_SIZES[1]
    runs = (TransferRun(1, 0, 0, 0, small),  # the whole odd-sized region, up to its last byte
            TransferRun(0, 5 * MiB, 0, 2 * MiB, MiB),
            TransferRun(1, 100, 0, 4 * MiB, 1000))
    read_and_check(reader, peer, TransferPlan(runs, 3))


def test_many_reads_in_flight_from_one_reader(kind, shared):
    reader, peer = shared.reader(kind)
    plans = [scattered_plan(64 << 10, 256, HOLDER_SIZES[0] // 4, 16 * MiB, seed=s) for s in range(4)]
    # Disjoint destination quarters so the concurrent reads cannot overwrite each other.
    plans = [TransferPlan(tuple(TransferRun(r.remote_region, r.remote_offset + i * 40 * MiB, 0,
                                            r.local_offset + i * 16 * MiB, r.nbytes) for r in p.runs), len(p))
             for i, p in enumerate(plans)]
    reader.dst[:] = 0
    handles = [reader.t.read(peer, p) for p in plans]
    for h in handles:
        assert h.wait(WAIT) is ReadState.DONE
    for p in plans:
        assert mismatches(p, {0: reader.dst}, remote_sizes()) == []


def test_concurrent_readers_in_other_processes(kind, shared, procs):
    holder = shared.holder(kind)
    for s in range(3):
        procs.append(spawn_reader(kind, holder, 32 << 10, 1024, seed=10 + s, iters=3))
    reader, peer = shared.reader(kind)  # and this process reads at the same time
    for s in range(3):
        read_and_check(reader, peer, scattered_plan(32 << 10, 1024, HOLDER_SIZES[0], reader.dst.nbytes, seed=s))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"reader pid {p.pid}: {out[-500:]} {err[-2000:]}"
        assert out.count("OK ") == 3


def test_reads_outside_registered_memory_rejected(kind, shared):
    reader, peer = shared.reader(kind)
    size0 = HOLDER_SIZES[0]
    bad_plans = {
        "past the end": (TransferRun(0, size0 - 100, 0, 0, 200), OutOfRange),
        "huge offset": (TransferRun(0, 1 << 50, 0, 0, 16), OutOfRange),
        "unknown remote region": (TransferRun(7, 0, 0, 0, 16), RegionUnknown),
        "past the local end": (TransferRun(0, 0, 0, reader.dst.nbytes - 8, 16), OutOfRange),
        "unknown local region": (TransferRun(0, 0, 3, 0, 16), RegionUnknown),
    }
    for name, (run, exc) in bad_plans.items():
        good = TransferRun(0, 0, 0, 0, 4096)
        err = expect_error(lambda: reader.t.read(peer, TransferPlan((good, run), 2)).wait(WAIT), exc)
        assert str(err), name
        # The same bad run hidden among many good ones (transports may batch-check large plans).
        many = tuple(TransferRun(0, i * 4096, 0, i * 4096, 4096) for i in range(200))
        many = many[:150] + (run,) + many[150:]
        expect_error(lambda: reader.t.read(peer, TransferPlan(many, len(many))).wait(WAIT), exc)
    # A rejected read leaves the transport usable.
    read_and_check(reader, peer, scattered_plan(32 << 10, 64, size0, reader.dst.nbytes, seed=3))


@pytest.mark.parametrize("pad", [0, 40])  # few runs (plain-Python checks) and many (vectorised)
def test_zero_length_runs_are_skipped_but_still_checked(kind, shared, pad):
    """The one run rule (pdxfer/transport/runs.py): plans built from empty token ranges carry
    zero-length runs; every transport skips them, yet still rejects one naming a bad region."""
    reader, peer = shared.reader(kind)
    size0, size1 = HOLDER_SIZES
    good = tuple(TransferRun(0, i * 8192, 0, i * 8192, 4096) for i in range(pad))
    empty = (TransferRun(0, 0, 0, 0, 0),
             TransferRun(1, size1, 0, reader.dst.nbytes, 0),  # at the very ends of both regions
             TransferRun(0, 3 * MiB, 0, MiB, 0))
    real = TransferRun(1, 10, 0, 2 * MiB + 5, 1000)
    plan = TransferPlan(good + empty[:2] + (real,) + empty[2:], pad + 4)
    read_and_check(reader, peer, plan)
    untouched = np.concatenate([reader.dst[pad * 8192:2 * MiB + 5], reader.dst[2 * MiB + 1005:]])
    assert not untouched.any(), "a zero-length run wrote bytes"
    # A plan of nothing but zero-length runs completes at once.
    assert reader.t.read(peer, TransferPlan(empty, 3)).wait(WAIT) is ReadState.DONE
    for bad, exc in ((TransferRun(7, 0, 0, 0, 0), RegionUnknown), (TransferRun(0, 0, 3, 0, 0), RegionUnknown),
                     (TransferRun(1, size1 + 1, 0, 0, 0), OutOfRange),
                     (TransferRun(0, 0, 0, reader.dst.nbytes + 1, 0), OutOfRange),
                     (TransferRun(0, size0 // 2, 0, 0, -1), OutOfRange)):
        expect_error(lambda: reader.t.read(peer, TransferPlan(good + (bad,), pad + 1)).wait(WAIT), exc)


def test_bad_metadata_and_unreachable_peer(kind, reader_factory, holder_factory):
    reader = reader_factory(kind, MiB)
    with pytest.raises(MetadataError):
        reader.t.connect(b"\x00not metadata\xff", timeout=2)
    holder = holder_factory(kind, sizes=(MiB,))
    stop(holder.proc)
    t0 = time.monotonic()
    with pytest.raises((PeerUnreachable, PeerDied)):
        peer = reader.t.connect(holder.meta, timeout=3)
        reader.t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 4096),), 1)).wait(5)
    assert time.monotonic() - t0 < 10


def _big_pending_read(reader, peer):
    """A read of the whole 160 MiB region in 256 KiB blocks: long enough to catch in flight."""
    return reader.t.read(peer, _big_plan(reader))


def _big_plan(reader) -> TransferPlan:
    return scattered_plan(256 << 10, 640, HOLDER_SIZES[0], reader.dst.nbytes, seed=9)


def _assert_held(h, for_s: float = 0.3) -> None:
    """The read is in flight, and stays so while its holder is frozen: nothing can finish it, so
    what the test does next (kill, cancel, close) meets a read that is really pending."""
    assert h.poll() is ReadState.PENDING, "the read finished from a frozen holder: it was never in flight"
    time.sleep(for_s)
    assert h.poll() is ReadState.PENDING, f"the read finished within {for_s} s from a frozen holder"


def test_holder_killed_mid_read_gives_typed_error_in_time(kind, holder_factory, reader_factory,
                                                          freeze_holds_reads):
    if freeze_holds_reads is None:
        _kill_during_a_long_read(kind, holder_factory, reader_factory)
        return
    holder = holder_factory(kind, prefix_cmd=freeze_holds_reads)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=10)
    read_and_check(reader, peer, scattered_plan(32 << 10, 64, HOLDER_SIZES[0], reader.dst.nbytes))
    freeze(holder.proc.pid)  # a frozen holder cannot finish the read: it is surely in flight
    try:
        h = _big_pending_read(reader, peer)
        _assert_held(h)
    finally:
        os.kill(holder.proc.pid, signal.SIGKILL)
    holder.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises((PeerDied, PeerUnreachable)):
        h.wait(DEATH_BOUND_S)
    assert time.monotonic() - t0 < DEATH_BOUND_S


def _kill_during_a_long_read(kind, holder_factory, reader_factory) -> None:
    """Where a frozen holder still serves reads (one-sided RDMA, answered by the NIC or the
    kernel's rxe without the holder's CPU), the read is kept in flight by its size: the same plan
    is read whole to time it, then the holder is killed a tenth of that time into another read,
    which must fail typed (a DONE would mean it was never in flight)."""
    holder = holder_factory(kind)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=WAIT)
    plan = _big_plan(reader)
    whole = float("inf")
    for _ in range(2):  # the first read also pays for faulting pages in: time the warm one
        t0 = time.monotonic()
        read_and_check(reader, peer, plan)
        whole = min(whole, time.monotonic() - t0)
    assert whole > 0.5, f"a {plan.total_bytes} B read took {whole:.2f} s: too short to kill the holder in it"
    # The post itself may take most of the read (and hold the GIL), so another process kills.
    killer = subprocess.Popen(["sh", "-c", f"sleep {whole / 10:.3f}; kill -9 {holder.proc.pid}"])
    t0 = time.monotonic()
    try:
        expect_error(lambda: reader.t.read(peer, plan).wait(DEATH_BOUND_S), (PeerDied, PeerUnreachable))
    finally:
        killer.wait(whole + 10)
    holder.proc.wait(10)
    took = time.monotonic() - t0
    print(f"holder killed {whole / 10:.2f} s into a {whole:.2f} s read: typed error {took:.2f} s after the post")
    assert took < whole / 10 + DEATH_BOUND_S


def test_cancel_is_bounded_and_transport_stays_usable(kind, holder_factory, reader_factory, freeze_holds_reads):
    holder = holder_factory(kind, prefix_cmd=freeze_holds_reads)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=10)
    freeze(holder.proc.pid)
    try:
        h = _big_pending_read(reader, peer)
        _assert_held(h)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            h.wait(0.3)  # a bounded wait on a frozen holder times out, it does not hang
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        h.cancel()
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while h.poll() is ReadState.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    # It was held until the cancel, so it cannot have completed: cancelled, and saying so.
    assert h.poll() is ReadState.CANCELLED
    with pytest.raises(TransferCancelled):
        h.wait(1)
    read_and_check(reader, peer, scattered_plan(32 << 10, 512, HOLDER_SIZES[0], reader.dst.nbytes, seed=4))


def test_reader_killed_holder_keeps_serving(kind, holder_factory, reader_factory, procs):
    holder = holder_factory(kind)
    victim = spawn_reader(kind, holder, 256 << 10, 512, loop=True)
    procs.append(victim)
    read_line(victim, "OK ", 60)  # it is reading in a loop now
    victim.kill()
    victim.wait(10)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=10)
    for s in range(2):
        read_and_check(reader, peer, scattered_plan(32 << 10, 1024, HOLDER_SIZES[0], reader.dst.nbytes, seed=s))
    assert holder.proc.poll() is None


def test_reconnect_after_holder_restart(kind, holder_factory, reader_factory):
    reader = reader_factory(kind)
    plan = scattered_plan(32 << 10, 256, HOLDER_SIZES[0], reader.dst.nbytes, seed=5)
    first = holder_factory(kind)
    peer = reader.t.connect(first.meta, timeout=10)
    read_and_check(reader, peer, plan)
    stop(first.proc)
    t0 = time.monotonic()
    with pytest.raises((PeerDied, PeerUnreachable)):
        reader.t.read(peer, plan).wait(10)
    assert time.monotonic() - t0 < 10
    second = holder_factory(kind, seed=1)  # other bytes: a read served by stale state would show
    peer2 = reader.t.connect(second.meta, timeout=10)
    read_and_check(reader, peer2, plan, seed=second.seed)
    reader.t.disconnect(peer)


def test_close_fails_in_flight_reads_with_cancelled(kind, holder_factory, reader_factory, freeze_holds_reads):
    holder = holder_factory(kind, prefix_cmd=freeze_holds_reads)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=10)
    freeze(holder.proc.pid)
    try:
        h = _big_pending_read(reader, peer)
        _assert_held(h)
        t0 = time.monotonic()
        reader.t.close()
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
    with pytest.raises(TransferCancelled):
        h.wait(5)
    reader.t.close()  # idempotent
