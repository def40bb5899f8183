"""Converting loads through the worker's staging area, holder in another process, real transport.

The holder (``kv_peer``) serves real KV in vLLM's CPU format at one block size; this process is a
connector worker (``WorkerSide``) with another block size and a small staging area. Every reader
element is compared with the value it must hold after the load (the pattern for tokens read, the
filler everywhere else). The master is a stand-in that always confirms the lock: what is tested
here is staging, not validation.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdxfer.kv.layout import CPU, KVLayout
from pdxfer.transport.base import ReadHandle, ReadState, TransferCancelled
from pdxfer.contracts.connector_config import parse_extra_config
from pdxfer.vllm.metadata import EndpointRef, HolderRef, LoadSpec, NodeRead, PdxferConnectorMetadata
from pdxfer.vllm.worker.worker_side import WorkerSide
from tests.kv_pattern import as_cache, decode, describe, encode, pattern_logical

from .conftest import REPO, _opt_args, child_env, read_line, transport_options

LAYERS, HEADS, D = 2, 4, 64  # float32: 4 KiB per token over all layers, K and V
TOKEN_BYTES = LAYERS * 2 * HEADS * D * 4
NTOK = 1000  # the holder's sequence
FILLER = -2.0
WAIT_S = 20.0


def _blocks(ntok: int, block: int, spare: int, seed: int) -> tuple[int, list[int]]:
    """(pool size, shuffled block ids of the sequence): no test may rely on consecutive blocks."""
    used = -(-ntok // block)
    ids = np.random.default_rng(seed).permutation(used + spare)[:used]
    return used + spare, [int(b) for b in ids]


@dataclass
class Holder:
    meta: bytes
    layout: KVLayout
    blocks: list[int]
    node_id: str = "holder"

    def ref(self, kind: str) -> HolderRef:
        return HolderRef(self.node_id, kind, (EndpointRef(0, self.meta, self.layout.to_wire()),), HEADS)


@pytest.fixture
def start_holder(procs):
    def start(kind: str, block: int) -> Holder:
        nblocks, blocks = _blocks(NTOK, block, 3, seed=block)
        args = ["--kind", kind, "--format", CPU, "--block", str(block), "--num-blocks", str(nblocks),
                "--layers", str(LAYERS), "--total-heads", str(HEADS), "--tp", "1", "--rank", "0",
                "--head-dim", str(D), "--ntokens", str(NTOK), "--blocks", ",".join(map(str, blocks)),
                *_opt_args(transport_options(kind))]
        proc = subprocess.Popen([sys.executable, "-m", "tests.transport.kv_peer", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
        procs.append(proc)
        _, meta, layout = read_line(proc, "META ", 60.0).split(" ", 2)
        return Holder(bytes.fromhex(meta), KVLayout.from_wire(json.loads(layout)), blocks)

    return start


class _Master:
    """Confirms every lock (the worker asks at release whether the lock held)."""

    def __init__(self, *_a, **_kw) -> None:
        self.released: list[str] = []

    def release(self, lock_id: str) -> bool:
        self.released.append(lock_id)
        return True

    def close(self) -> None:
        pass


class Reader:
    """A connector worker with CPU-format KV of ``block`` tokens per block, all blocks FILLER."""

    def __init__(self, kind: str, block: int, pool_blocks: int = 0, **cfg) -> None:
        self.kind, self.block = kind, block
        self.nblocks = pool_blocks or _blocks(NTOK, block, 3, seed=0)[0]
        self.phys = encode(CPU, torch.full((LAYERS, 2, self.nblocks, block, HEADS, D), FILLER))
        layout = describe(CPU, self.phys, block)
        conf = parse_extra_config({"master": "127.0.0.1:1", "transport": kind, **cfg})
        self.worker = WorkerSide(conf, node_id="reader", rank=0, expected_fingerprint=layout.fingerprint(),
                                 block_size=block, client_factory=_Master, kv_format=CPU,
                                 max_model_len=NTOK + 24)
        self.worker.register_kv_caches(as_cache(self.phys))
        self.finished: set[str] = set()

    def post(self, holder: Holder, rid: str, start: int, end: int, seed: int = 0,
             table: list[int] | None = None) -> list[int]:
        """Post the load of tokens [start, end) of the holder's sequence into ``table`` (default:
        fresh shuffled blocks; the reader had tokens [0, start) itself); returns the block table."""
        if table is None:
            table = [int(b) for b in np.random.default_rng(seed).permutation(self.nblocks)[: -(-end // self.block)]]
        hb, lb = holder.layout.block_size, self.block
        read = NodeRead(holder.node_id, tuple(holder.blocks[start // hb: -(-end // hb)]),
                        tuple(table[start // lb:]), hb, start // hb * hb, start // lb * lb, start, end - start)
        spec = LoadSpec(rid, f"lock-{rid}", end - start, (read,), time.time() + 60.0, tuple(table[start // lb:]),
                        holders=(holder.ref(self.kind),))
        self.worker.start_loads(PdxferConnectorMetadata([spec]))
        return table

    def wait(self, *rids: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not set(rids) <= self.finished:
            assert time.monotonic() < deadline, f"loads {set(rids) - self.finished} never finished"
            self.finished |= self.worker.get_finished()
            time.sleep(0.002)

    def check(self, table: list[int], start: int, end: int) -> None:
        """Tokens [start, end) of ``table`` hold the holder's pattern, every other element FILLER."""
        got = decode(CPU, self.phys)
        want = pattern_logical(LAYERS, table, self.nblocks, self.block, 0, HEADS, HEADS, D, end, filler=FILLER)
        seq = torch.as_tensor(table)
        before = torch.arange(start)
        want[:, :, seq[before // self.block], before % self.block] = FILLER
        bad = (got != want).nonzero()
        assert len(bad) == 0, (f"{len(bad)} wrong elements; first [layer, K/V, block, slot, head, dim] = "
                               f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}")

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def make_reader():
    made: list[Reader] = []

    def make(*args, **kw) -> Reader:
        r = Reader(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("hb,lb", [(128, 32), (32, 128)])
def test_a_load_larger_than_staging_streams_through_it_in_pieces(kind, start_holder, make_reader, hb, lb):
    holder = start_holder(kind, hb)
    reader = make_reader(kind, lb, staging_mib=1)
    start, end = 40, NTOK - 1
    assert (end - start) * TOKEN_BYTES > 3 << 20  # several times the staging area
    table = reader.post(holder, "long", start, end, seed=5)
    reader.wait("long")
    assert reader.worker.take_load_errors() == set()
    reader.check(table, start, end)
    assert reader.worker.stats.loads_ok == 1 and reader.worker.stats.tokens_loaded == end - start
    assert reader.worker._staging.area.in_use == 0  # every piece's range was given back


def test_concurrent_loads_larger_than_staging_share_it_and_all_move(kind, start_holder, make_reader):
    holder = start_holder(kind, 128)
    per_load = -(-NTOK // 32)
    reader = make_reader(kind, 32, pool_blocks=3 * per_load + 3, staging_mib=1)
    ids = [int(b) for b in np.random.default_rng(20).permutation(reader.nblocks)]
    loads = {f"c{i}": (40 + 100 * i, NTOK - 1 - 50 * i) for i in range(3)}
    tables = {rid: reader.post(holder, rid, a, b, table=ids[i * per_load:(i + 1) * per_load][: -(-b // 32)])
              for i, (rid, (a, b)) in enumerate(loads.items())}
    reader.wait(*loads)
    assert reader.worker.take_load_errors() == set()
    # The three loads wrote disjoint reader blocks: check each load's blocks against its tokens.
    got = decode(CPU, reader.phys)
    for rid, (a, b) in loads.items():
        table = tables[rid]
        want = pattern_logical(LAYERS, table, reader.nblocks, reader.block, 0, HEADS, HEADS, D, b, filler=FILLER)
        seq = torch.as_tensor(table)
        before = torch.arange(a)
        want[:, :, seq[before // 32], before % 32] = FILLER
        mine = sorted(set(table[a // 32:]))
        assert torch.equal(got[:, :, mine], want[:, :, mine]), rid
    stats = reader.worker.stats
    assert (stats.loads_ok, stats.staging_full) == (3, 0)
    assert reader.worker._staging.area.in_use == 0


def test_loads_that_find_staging_full_wait_for_room_then_move(kind, start_holder, make_reader):
    holder = start_holder(kind, 128)
    reader = make_reader(kind, 32, staging_mib=1)
    area = reader.worker._staging.area
    other = area.alloc(area.nbytes)  # concurrent loads hold the whole area
    assert other == 0
    start, end = 300, 700
    table = reader.post(holder, "waits", start, end, seed=6)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        reader.finished |= reader.worker.get_finished()
        time.sleep(0.01)
    assert "waits" not in reader.finished  # no room: it waits, it does not fail
    area.free(other)
    reader.wait("waits")
    assert reader.worker.take_load_errors() == set()
    reader.check(table, start, end)
    stats = reader.worker.stats
    assert (stats.staging_waits, stats.staging_full, stats.loads_ok) == (1, 0, 1)


def test_a_load_that_never_gets_room_fails_naming_the_sizes(kind, start_holder, make_reader, caplog):
    holder = start_holder(kind, 128)
    reader = make_reader(kind, 32, staging_mib=1, load_timeout_s=0.4)
    area = reader.worker._staging.area
    assert area.alloc(area.nbytes) == 0  # and they never give it back
    start, end = 300, 700
    table = reader.post(holder, "starved", start, end, seed=7)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="pdxfer.vllm.worker"):
        reader.wait("starved", timeout=5.0)
    assert time.monotonic() - t0 < 2.0  # bounded by the load's own bound
    assert reader.worker.take_load_errors() == set(table[start // 32:])  # vLLM recomputes them all
    stats = reader.worker.stats.take()
    assert (stats["staging_waits"], stats["staging_full"], stats["loads_failed"]) == (1, 1, 1)
    from pdxfer.vllm.connector_stats import PdxferKVConnectorStats  # what reaches /metrics

    shipped = PdxferKVConnectorStats(data=stats)
    assert (shipped.data["staging_waits"], shipped.data["staging_full"]) == (1, 1)
    assert shipped.reduce()["Loads failed for lack of staging"] == 1
    msg = caplog.text
    assert "StagingFull" in msg and f"{128 * TOKEN_BYTES} bytes per holder block" in msg
    assert f"of its {1 << 20} bytes" in msg
    reader.check(table, 0, 0)  # nothing was written


def test_a_holder_block_larger_than_the_staging_area_is_refused_clearly(kind, start_holder, make_reader, caplog):
    holder = start_holder(kind, 512)  # 2 MiB per holder block
    reader = make_reader(kind, 32, staging_mib=1)
    with caplog.at_level("WARNING", logger="pdxfer.vllm.worker"):
        table = reader.post(holder, "huge", 64, 900, seed=8)
        reader.wait("huge")
    assert reader.worker.take_load_errors() == set(table[2:])
    assert reader.worker.stats.staging_full == 1
    assert "StagingTooSmall" in caplog.text and f"stages {512 * TOKEN_BYTES} bytes" in caplog.text


class _LateRead(ReadHandle):
    """A read whose transport broke its bound: cancel does not stop it, it stays PENDING, and its
    bytes land whenever ``land`` is called. ``honours_disconnect``: disconnecting its peer stops
    it (what a transport's disconnect promises); else nothing ever does."""

    def __init__(self, plan, mem: np.ndarray, region: int, honours_disconnect: bool) -> None:
        self.plan, self.mem, self.region = plan, mem, region
        self.honours_disconnect = honours_disconnect
        self.stopped = False
        self.landed = 0

    def poll(self) -> ReadState:
        return ReadState.CANCELLED if self.stopped else ReadState.PENDING

    def wait(self, timeout: float) -> ReadState:
        raise AssertionError("the worker never waits on a read")

    def cancel(self) -> None:
        pass  # the broken promise

    @property
    def error(self):
        return TransferCancelled("disconnected") if self.stopped else None

    def land(self) -> None:
        if self.stopped:
            return
        for r in self.plan.runs:
            assert r.local_region == self.region
            self.mem[r.local_offset: r.local_offset + r.nbytes] = 0x7F  # what the old read brings
            self.landed += r.nbytes


class _LandsAfter(ReadHandle):
    """A real read; the late read's bytes land right after it finished, before it is scattered."""

    def __init__(self, inner: ReadHandle, late: _LateRead) -> None:
        self.inner, self.late, self.fired = inner, late, False

    def poll(self) -> ReadState:
        state = self.inner.poll()
        if state is ReadState.DONE and not self.fired:
            self.fired = True
            self.late.land()
        return state

    def wait(self, timeout: float) -> ReadState:
        return self.inner.wait(timeout)

    def cancel(self) -> None:
        self.inner.cancel()

    @property
    def error(self):
        return self.inner.error


@pytest.mark.parametrize("honours_disconnect", [True, False])
def test_a_read_that_never_stopped_cannot_overwrite_the_next_load(start_holder, make_reader, monkeypatch,
                                                                 caplog, honours_disconnect):
    import pdxfer.vllm.worker.staging as ws

    holder = start_holder("tcp", 128)
    reader = make_reader("tcp", 32, staging_mib=4, load_timeout_s=0.3, read_timeout_floor_s=0.1)
    worker = reader.worker
    worker._stop_bound_s = 0.6  # how long a failed read may take to stop (10x load_timeout_s in use)
    monkeypatch.setattr(ws, "QUARANTINE_GRACE_S", 3.0)
    t = worker.transport
    real_read, real_disconnect = t.read, t.disconnect
    late: list[_LateRead] = []

    def read(peer, plan):
        if not late:
            late.append(_LateRead(plan, worker._staging._mem, worker._staging.region_index, honours_disconnect))
            return late[0]
        return _LandsAfter(real_read(peer, plan), late[0])

    def disconnect(peer):
        if late and late[0].honours_disconnect:
            late[0].stopped = True
        real_disconnect(peer)

    monkeypatch.setattr(t, "read", read)
    monkeypatch.setattr(t, "disconnect", disconnect)
    start, end = 300, 400
    first = reader.post(holder, "old", start, end, seed=9)
    with caplog.at_level("ERROR", logger="pdxfer.vllm.worker"):
        reader.wait("old", timeout=10.0)
    assert worker.take_load_errors() == set(first[start // 32:])
    assert "not stopped" in caplog.text
    table = reader.post(holder, "new", start, end, seed=10)
    reader.wait("new")
    assert worker.take_load_errors() == set()
    assert late[0].landed or honours_disconnect  # the old read's bytes did land, where they could do no harm
    reader.check(table, start, end)  # no element of the new load came from the old read
    assert worker.stats.reads_unstopped == 1
    # The quarantine is bounded: once its holder was disconnected, the range is given back.
    deadline = time.monotonic() + 10.0
    while worker._staging.area.in_use:
        assert time.monotonic() < deadline, "the quarantined staging range was never given back"
        worker.get_finished()
        time.sleep(0.05)


def test_a_direct_read_that_never_stopped_is_cut_off_before_the_load_is_reported(start_holder, make_reader,
                                                                                  monkeypatch):
    holder = start_holder("tcp", 32)
    reader = make_reader("tcp", 32, load_timeout_s=0.3, read_timeout_floor_s=0.1)  # same blocks: READ in place
    worker = reader.worker
    worker._stop_bound_s = 0.6
    t = worker.transport
    real_disconnect = t.disconnect
    late: list[_LateRead] = []
    region = worker.layout.regions[0]
    mem = np.frombuffer((ctypes.c_uint8 * region.nbytes).from_address(region.ptr), dtype=np.uint8)

    def read(peer, plan):
        late.append(_LateRead(plan, mem, 0, honours_disconnect=True))
        return late[-1]

    def disconnect(peer):
        for r in late:
            r.stopped = True
        real_disconnect(peer)

    monkeypatch.setattr(t, "read", read)
    monkeypatch.setattr(t, "disconnect", disconnect)
    table = reader.post(holder, "old", 320, 400, seed=11)
    reader.wait("old", timeout=10.0)
    assert worker.take_load_errors() == set(table[10:])
    # vLLM has the blocks back now: nothing of that read may land in them any more.
    late[0].land()
    assert late[0].landed == 0
    reader.check(table, 0, 0)
    assert worker.connected_holders() == []  # a later load reconnects
