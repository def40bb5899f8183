"""Device memory over TCP through the pinned bounce buffer, with no GPU.

Regions are labelled cuda:0 but backed by CPU tensors, and both sides copy them with an
asynchronous CPU stand-in (a FIFO thread per stream sleeping before every copy), so bytes used
before their copy event completed are stale here as on a GPU. Holders are separate processes
(``tests/transport/peer_proc.py hold --device-regions``); this process is the reader. Nothing
here has run on a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from pdxfer.device import CpuStandIn
from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.probe.pattern import mismatches, pattern, scattered_plan
from pdxfer.transport.base import PeerDied, ReadHandle, ReadState, RegisteredRegion, TransportError
from pdxfer.transport.tcp import TcpTransport
from pdxfer.transport.tcp.bounce import segment
from tests.transport.conftest import Holder, read_line, spawn, stop

MiB = 1 << 20
SLICE = MiB
SLICES = 3


def start_device_holder(sizes: tuple[int, ...], device_regions: str = "0", delay: float = 0.001,
                        slice_bytes: int = SLICE, slices: int = SLICES, **opts) -> Holder:
    extra = [a for k, v in opts.items() for a in ("--opt", f"{k}={v}")]
    proc = spawn(["hold", "--kind", "tcp", "--sizes", ",".join(map(str, sizes)),
                  "--device-regions", device_regions, "--standin-delay", str(delay),
                  "--opt", f"bounce_slice_bytes={slice_bytes}", "--opt", f"bounce_slices={slices}", *extra])
    try:
        line = read_line(proc, "META ", 60)
    except BaseException:
        stop(proc)
        raise
    return Holder("tcp", proc, bytes.fromhex(line.split()[1]), sizes)


def holder_stats(h: Holder) -> dict:
    """Stop the holder cleanly and return the bounce counters it prints on SIGTERM."""
    h.proc.send_signal(signal.SIGTERM)
    return json.loads(read_line(h.proc, "STATS ", 20).split(" ", 1)[1])


class HeldCopies(CpuStandIn):
    """The asynchronous stand-in, plus a gate: copies enqueued while it is held wait on their
    stream until ``release()``. With copies held, what the pipeline does next no longer depends
    on how fast the copies run."""

    GATE_BOUND_S = 60.0  # a test that never releases still frees the stream threads

    def __init__(self, delay_s: float) -> None:
        super().__init__(asynchronous=True, delay_s=delay_s)
        self._gate = threading.Event()
        self._gate.set()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def copy(self, dst, dst_off, src, src_off, nbytes, stream) -> None:
        gate = self._gate
        if not gate.is_set():
            self._stream(stream).submit(lambda: gate.wait(self.GATE_BOUND_S))
        super().copy(dst, dst_off, src, src_off, nbytes, stream)


class DeviceReader:
    """This process's side: regions labelled cuda:0 (backed by CPU tensors with guard bytes around
    them) or host, copied with an asynchronous stand-in whose copies a test can hold."""

    GUARD = 4096

    def __init__(self, sizes: tuple[int, ...], on_device: tuple[bool, ...] | None = None, delay: float = 0.001,
                 slice_bytes: int = SLICE, slices: int = SLICES, **opts) -> None:
        on_device = on_device or (True,) * len(sizes)
        self.raw: list[torch.Tensor] = []
        self.dst: list[np.ndarray] = []
        self.ops = HeldCopies(delay)
        self.t = TcpTransport(device_ops=self.ops, bounce_slice_bytes=slice_bytes, bounce_slices=slices, **opts)
        regions = []
        for i, (n, dev) in enumerate(zip(sizes, on_device)):
            raw = torch.full((n + 2 * self.GUARD,), 0xA5, dtype=torch.uint8)
            view = raw[self.GUARD:self.GUARD + n]
            view.zero_()
            self.raw.append(raw)
            self.dst.append(view.numpy())
            if dev:
                regions.append(RegisteredRegion(i, view.data_ptr(), n, "cuda:0", tensor=view))
            else:
                regions.append(RegisteredRegion(i, view.data_ptr(), n))
        self.t.register(regions)

    def local(self) -> dict[int, np.ndarray]:
        return dict(enumerate(self.dst))

    def guards_intact(self) -> bool:
        g = self.GUARD
        return all(bool((r[:g] == 0xA5).all() and (r[-g:] == 0xA5).all()) for r in self.raw)

    def drain_copies(self) -> None:
        """Return once every host-to-device copy enqueued so far has run: the copy stream is
        FIFO, so an event recorded behind them completes after the last."""
        ev = self.ops.record_event(self.t._table.plane.stream(0, "h2d"))
        assert ev.wait(30), "the reader's copy stream never drained"

    def close(self) -> None:
        self.t.close()
        self.ops.close()


@pytest.fixture
def made():
    """Holders and readers a test makes: all stopped at teardown, even on failure."""
    holders: list[Holder] = []
    readers: list[DeviceReader] = []
    yield holders, readers
    for r in readers:
        r.close()
    for h in holders:
        stop(h.proc)


def _setup(made, hsizes, rsizes, hdev="0", rdev=None, hdelay=0.001, rdelay=0.001, hopts=None, **kw):
    holders, readers = made
    h = start_device_holder(hsizes, hdev, hdelay, **(hopts or {}))
    holders.append(h)
    r = DeviceReader(rsizes, rdev, rdelay, **kw)
    readers.append(r)
    return h, r, r.t.connect(h.meta, timeout=10)


def _sizes(h: Holder) -> dict[int, int]:
    return dict(enumerate(h.sizes))


def _read_with_copies_held(r: DeviceReader, peer: str, plan: TransferPlan) -> ReadHandle:
    """Post ``plan`` with the reader's copies held and return its handle once a slice arrived
    while an earlier slice's copy was still waiting: the socket does not wait for the copies.
    Each request takes one slice before it sends and the pool has a third, so some request
    takes a second slice for its next segment under any interleaving."""
    r.ops.hold()
    try:
        handle = r.t.read(peer, plan)
        deadline = time.monotonic() + 30
        while r.t.bounce_stats()["h2d_overlapped"] < 1:
            assert time.monotonic() < deadline, (f"no slice was received while a copy was pending: "
                                                 f"{r.t.bounce_stats()}")
            time.sleep(0.01)
        # Every copy is held: no byte has reached the destination, and the read cannot be over.
        assert handle.poll() is ReadState.PENDING
        assert not any(d.any() for d in r.dst)
    finally:
        r.ops.release()
    return handle


def _landed_slices(dst: np.ndarray, size: int) -> int:
    """How many leading SLICE-sized pieces of a read of [0, size) landed; each exact, none after a
    piece that did not (one connection, one FIFO copy stream: slices land in order)."""
    want = pattern(0, size)
    landed = 0
    for off in range(0, size, SLICE):
        got = dst[off:off + SLICE]
        if got.any():
            assert off == landed * SLICE, f"slice at {off} landed after one that did not"
            assert np.array_equal(got, want[off:off + SLICE]), f"slice at {off} is neither untouched nor exact"
            landed += 1
    return landed


# ---------------------------------------------------------------------------- segmentation

@pytest.mark.parametrize("seed", range(20))
def test_segments_carry_every_byte_once_in_order_and_slices_fit(seed):
    rng = np.random.default_rng(seed)
    group_of = (None, 0, 0, None)
    n = int(rng.integers(1, 40))
    regions = rng.integers(0, 4, n).tolist()
    offsets = rng.integers(0, 1000, n).tolist()
    lengths = rng.choice([0, 1, 7, 100, 333, 1000], n).tolist()
    segs = segment(regions, offsets, lengths, group_of, slice_bytes=256)
    flat = [(r, o + k) for r, o, ln in zip(regions, offsets, lengths) for k in range(ln)]
    got = [(r, o + k) for s in segs for r, o, ln in s.runs for k in range(ln)]
    assert got == flat
    for s in segs:
        assert s.nbytes == sum(ln for _, _, ln in s.runs)
        assert all(group_of[r] == s.group for r, _, _ in s.runs)
        if s.group is not None:
            assert 0 < s.nbytes <= 256


# ---------------------------------------------------------------------------- registration

def test_device_region_without_tensor_or_with_a_wrong_one_is_refused():
    t = TcpTransport(device_ops=CpuStandIn())
    try:
        with pytest.raises(TransportError, match="region 0 is on cuda:0 but carries no tensor"):
            t.register([RegisteredRegion(0, 0x1000, 64, "cuda:0")])
        bad = torch.zeros(32, dtype=torch.uint8)
        with pytest.raises(TransportError, match="region 0: tensor must be flat uint8 of 64 bytes"):
            t.register([RegisteredRegion(0, bad.data_ptr(), 64, "cuda:0", tensor=bad)])
        with pytest.raises(ValueError, match="bounce_slices"):
            TcpTransport(bounce_slices=0)
    finally:
        t.close()


def test_registered_region_tensor_is_optional_and_ignored_by_equality():
    t = torch.zeros(8, dtype=torch.uint8)
    assert RegisteredRegion(0, 1, 8) == RegisteredRegion(0, 1, 8, "cpu", tensor=None)
    assert RegisteredRegion(0, 1, 8, "cuda:0", tensor=t) == RegisteredRegion(0, 1, 8, "cuda:0")
    assert "tensor" not in repr(RegisteredRegion(0, 1, 8, "cuda:0", tensor=t))


# ---------------------------------------------------------------------------- bytes

def _check_holder_pipeline(theirs: dict, slices: int) -> None:
    """What the holder's counters show under any interleaving. Whichever request stages first
    finds the pool's third slice free, so its next segment's copies are enqueued before its first
    slice goes out. Whether a copy was still running when a slice went out depends on timing:
    only its bounds are checked."""
    assert theirs["d2h_slices"] == slices
    assert 1 <= theirs["d2h_staged_ahead"] <= slices
    assert theirs["d2h_overlapped"] <= theirs["d2h_staged_ahead"]
    assert 2 <= theirs["send_peak_slices"] <= SLICES
    assert theirs["leaked_slices"] == 0


def test_single_run_larger_than_the_bounce_buffer_is_byte_exact(made):
    # The reader's copies are slow (the network outruns them), so at the end several are queued.
    h, r, peer = _setup(made, (12 * MiB + 77,), (12 * MiB + 1000,), rdelay=0.05)
    want = pattern(0, h.sizes[0])[77:77 + 10 * MiB]
    # Odd offsets on both sides, 10 MiB: ten slices through a buffer of three, over two connections
    # (5 MiB each: five whole slices apiece).
    plan = TransferPlan((TransferRun(0, 77, 0, 999, 10 * MiB),), 1)
    assert _read_with_copies_held(r, peer, plan).wait(30) is ReadState.DONE
    assert np.array_equal(r.dst[0][999:999 + 10 * MiB], want), "DONE before every byte had landed"
    assert mismatches(plan, r.local(), _sizes(h)) == []
    assert not r.dst[0][:999].any() and not r.dst[0][999 + 10 * MiB:].any()
    assert r.guards_intact()
    mine = r.t.bounce_stats()
    assert mine["h2d_slices"] == 10
    # A request's first slice has no earlier copy to overlap.
    assert 1 <= mine["h2d_overlapped"] <= 10 - 2
    assert 2 <= mine["recv_peak_slices"] <= SLICES and mine["leaked_slices"] == 0
    _check_holder_pipeline(holder_stats(h), 10)


def test_many_scattered_runs_are_byte_exact_and_pipelined(made):
    h, r, peer = _setup(made, (8 * MiB,), (8 * MiB,), hdelay=0.0005, rdelay=0.0005)
    # 4 MiB in 1024 runs each side: 2 MiB per connection, two whole slices apiece.
    plan = scattered_plan(4096, 1024, 8 * MiB, 8 * MiB, seed=5)
    assert _read_with_copies_held(r, peer, plan).wait(30) is ReadState.DONE
    assert mismatches(plan, r.local(), _sizes(h)) == []
    assert r.guards_intact()
    touched = np.zeros(8 * MiB, dtype=bool)
    for run in plan.runs:
        touched[run.local_offset:run.local_offset + run.nbytes] = True
    assert not r.dst[0][~touched].any(), "bytes outside the plan's destinations were written"
    mine = r.t.bounce_stats()
    assert mine["h2d_slices"] == 4 and 1 <= mine["h2d_overlapped"] <= 4 - 2
    _check_holder_pipeline(holder_stats(h), 4)


def test_small_read_takes_one_slice_and_is_byte_exact(made):
    h, r, peer = _setup(made, (2 * MiB,), (2 * MiB,))
    plan = TransferPlan((TransferRun(0, 4093, 0, 17, 3000), TransferRun(0, 100, 0, 70000, 5)), 2)
    assert r.t.read(peer, plan).wait(10) is ReadState.DONE
    assert mismatches(plan, r.local(), _sizes(h)) == []


def test_concurrent_reads_are_each_byte_exact(made):
    h, r, peer = _setup(made, (16 * MiB,), (16 * MiB,), connections=3)
    plans = [scattered_plan(64 * 1024, 32, 16 * MiB, 4 * MiB, seed=s) for s in range(4)]
    # Four reads into four disjoint quarters of the destination, all in flight at once.
    plans = [TransferPlan(tuple(TransferRun(x.remote_region, x.remote_offset, 0, x.local_offset + q * 4 * MiB,
                                            x.nbytes) for x in p.runs), len(p.runs)) for q, p in enumerate(plans)]
    handles = [r.t.read(peer, p) for p in plans]
    assert [hd.wait(60) for hd in handles] == [ReadState.DONE] * 4
    for p in plans:
        assert mismatches(p, r.local(), _sizes(h)) == []
    assert r.t.bounce_stats()["leaked_slices"] == 0


def test_concurrent_reads_from_threads_share_the_pools_without_deadlock(made):
    h, r, peer = _setup(made, (8 * MiB,), (8 * MiB,), slices=2, hdelay=0.0002, rdelay=0.0002)
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(3):
            p = scattered_plan(16384, 32, 8 * MiB, MiB, seed=10 * k + i)
            p = TransferPlan(tuple(TransferRun(0, x.remote_offset, 0, x.local_offset + k * MiB, x.nbytes)
                                   for x in p.runs), 32)
            try:
                r.t.read(peer, p).wait(60)
            except TransportError as exc:
                errors.append(repr(exc))
                return
            bad = mismatches(p, r.local(), _sizes(h))
            if bad:
                errors.append(bad[0])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_mixed_plan_host_and_device_on_either_side(made):
    # Holder: region 0 on the device, region 1 in host memory; reader: region 0 host, 1 device.
    hs = (4 * MiB, MiB + 12345)
    h, r, peer = _setup(made, hs, (3 * MiB, 3 * MiB), hdev="0", rdev=(False, True), rdelay=0.005)
    runs = []
    for k in range(40):
        src = k % 2
        dst = (k // 2) % 2
        runs.append(TransferRun(src, (k * 24571) % (hs[src] - 60000), dst, k * 70001, 50000 + k))
    plan = TransferPlan(tuple(runs), len(runs))
    assert r.t.read(peer, plan).wait(30) is ReadState.DONE
    assert mismatches(plan, r.local(), _sizes(h)) == []
    assert r.guards_intact()
    # A host-only plan against a holder with device regions still takes the in-place path.
    host_only = TransferPlan((TransferRun(1, 5, 0, 0, MiB),), 1)
    assert r.t.read(peer, host_only).wait(10) is ReadState.DONE
    assert mismatches(host_only, r.local(), _sizes(h)) == []


def test_payload_crc_covers_bounced_bytes(made):
    h, r, peer = _setup(made, (4 * MiB,), (4 * MiB,), payload_crc=True)
    plan = scattered_plan(65536, 40, 4 * MiB, 4 * MiB, seed=2)
    assert r.t.read(peer, plan).wait(30) is ReadState.DONE
    assert mismatches(plan, r.local(), _sizes(h)) == []


# ---------------------------------------------------------------------------- faults

def test_holder_killed_mid_transfer_fails_peer_died_with_no_late_copy(made):
    # The holder copies fast, the reader's host-to-device copies are slow: when the holder dies
    # some of the reader's copies are always still queued, and the read must wait for them.
    # One connection holding six slices, small socket buffers: when the holder's death reaches the
    # reader, up to five of its slices are still being copied.
    size = 32 * MiB
    small = {"socket_buffer": 256 * 1024}
    h, r, peer = _setup(made, (size,), (size,), hdelay=0.05, rdelay=0.3, hopts=small, connections=1,
                        slices=6, **small)
    plan = TransferPlan((TransferRun(0, 0, 0, 0, size),), 1)
    handle = r.t.read(peer, plan)
    deadline = time.monotonic() + 30
    while r.t.bounce_stats()["h2d_slices"] < 4:
        assert time.monotonic() < deadline, "the read never got going"
        assert handle.poll() is ReadState.PENDING
        time.sleep(0.01)
    os.kill(h.proc.pid, signal.SIGKILL)
    with pytest.raises(PeerDied):
        handle.wait(15)  # the bound on noticing a dead holder, with every queued copy behind it
    after = r.dst[0].copy()
    mine = r.t.bounce_stats()
    r.drain_copies()
    assert np.array_equal(after, r.dst[0]), "destination changed after the failure was reported"
    # When the failure was reported, every slice whose copies had been enqueued had landed, exact
    # (at least the four counted before the kill), and nothing else was written.
    assert _landed_slices(after, size) == mine["h2d_slices"] >= 4
    assert mine["leaked_slices"] == 0
    assert r.guards_intact()


def test_cancel_mid_transfer_returns_only_after_queued_copies_landed(made):
    size = 16 * MiB
    small = {"socket_buffer": 256 * 1024}
    h, r, peer = _setup(made, (size,), (size,), hdelay=0.05, rdelay=0.3, hopts=small, connections=1,
                        slices=4, **small)
    handle = r.t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, size),), 1))
    deadline = time.monotonic() + 30
    while r.t.bounce_stats()["h2d_slices"] < 3:
        assert time.monotonic() < deadline, "the read never got going"
        assert handle.poll() is ReadState.PENDING
        time.sleep(0.01)
    handle.cancel(timeout=10)
    assert handle.poll() is ReadState.CANCELLED  # in flight: a finished read stays DONE
    after = r.dst[0].copy()
    mine = r.t.bounce_stats()
    r.drain_copies()
    assert np.array_equal(after, r.dst[0]), "destination changed after the read was cancelled"
    assert _landed_slices(after, size) == mine["h2d_slices"] >= 3
    # The transport goes on: the next read into the same memory is exact.
    plan = scattered_plan(SLICE, 3, size, size, seed=9)
    assert r.t.read(peer, plan).wait(30) is ReadState.DONE
    assert mismatches(plan, r.local(), _sizes(h)) == []


# ---------------------------------------------------------------------------- busy buffers, device errors
# In-process holders here: these reach into a transport's pool or copy engine.

class FailingCopies(CpuStandIn):
    """An asynchronous stand-in whose copies fail on the stream (as a faulting device copy does:
    the call returns, the event reports the error)."""

    def copy(self, dst, dst_off, src, src_off, nbytes, stream) -> None:
        def boom() -> None:
            raise RuntimeError("injected device fault")

        self._stream(stream).submit(boom)


def _pair(holder_ops, reader_ops, size: int = 4 * MiB, **hopts):
    src = torch.from_numpy(pattern(0, size).copy())
    dst = torch.zeros(size, dtype=torch.uint8)
    h = TcpTransport(device_ops=holder_ops, bounce_slice_bytes=SLICE, **hopts)
    h.register([RegisteredRegion(0, src.data_ptr(), size, "cuda:0", tensor=src)])
    r = TcpTransport(device_ops=reader_ops, bounce_slice_bytes=SLICE, connections=1)
    r.register([RegisteredRegion(0, dst.data_ptr(), size, "cuda:0", tensor=dst)])
    return h, r, r.connect(h.metadata()), src, dst


def test_busy_holder_buffer_answers_with_an_error_and_keeps_the_connection():
    ops = CpuStandIn(asynchronous=True)
    h, r, peer, src, dst = _pair(ops, ops, bounce_slices=1, device_timeout=0.3)
    try:
        plan = TransferPlan((TransferRun(0, 0, 0, 0, 2 * MiB),), 1)
        taken = h._table.plane.pool("send").acquire(1.0)  # the holder's only slice
        assert taken is not None
        with pytest.raises(TransportError, match="holder bounce buffer busy"):
            r.read(peer, plan).wait(10)
        h._table.plane.pool("send").release(taken)
        assert r.read(peer, plan).wait(10) is ReadState.DONE
        assert torch.equal(dst[:2 * MiB], src[:2 * MiB])
    finally:
        r.close()
        h.close()
        ops.close()


def test_device_copy_failures_fail_the_read_typed():
    good, bad = CpuStandIn(asynchronous=True), FailingCopies(asynchronous=True)
    plan = TransferPlan((TransferRun(0, 0, 0, 0, 3 * MiB),), 1)
    try:
        h, r, peer, _, _ = _pair(good, bad)
        try:
            with pytest.raises(TransportError, match="host-to-device copy failed: RuntimeError: injected"):
                r.read(peer, plan).wait(10)
        finally:
            r.close()
            h.close()
        h, r, peer, _, _ = _pair(bad, good)
        try:
            # The holder cannot take back a header it sent: it cuts the connection.
            with pytest.raises(PeerDied):
                r.read(peer, plan).wait(10)
        finally:
            r.close()
            h.close()
    finally:
        good.close()
        bad.close()
