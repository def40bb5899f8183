"""Converting loads through the worker's staging area, holder in another process, real transport.

The holder (``kv_peer``) serves real KV in vLLM's CPU format at one block size; this process is a
connector worker (``WorkerSide``) with another block size and a small staging area. Every reader
element is compared with the value it must hold after the load (the pattern for tokens read, the
filler everywhere else). The master is a stand-in that always confirms the lock: what is tested
here is staging, not validation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdxfer.layout import CPU, KVLayout
from pdxfer.transport.base import ReadHandle, ReadState, TransferCancelled
from pdxfer.vllm.config import parse_extra_config
from pdxfer.vllm.metadata import EndpointRef, HolderRef, LoadSpec, NodeRead, PdxferConnectorMetadata
from pdxfer.vllm.worker_side import WorkerSide
from tests.kv_pattern import as_cache, decode, describe, encode, pattern_logical

from .conftest import REPO, _opt_args, child_env, read_line, transport_options

LAYERS, HEADS, D = 2, 4, 64  # float32: 4 KiB per token over all layers, K and V
TOKEN_BYTES = LAYERS * 2 * HEADS * D * 4
NTOK = 1000  # the holder's sequence
FILLER = -2.0
WAIT_S = 20.0
_HAS_MAX_LEN = "max_model_len" in WorkerSide.__init__.__code__.co_varnames


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

    def __init__(self, kind: str, block: int, **cfg) -> None:
        self.kind, self.block = kind, block
        self.nblocks, _ = _blocks(NTOK, block, 3, seed=0)
        self.phys = encode(CPU, torch.full((LAYERS, 2, self.nblocks, block, HEADS, D), FILLER))
        layout = describe(CPU, self.phys, block)
        conf = parse_extra_config({"master": "127.0.0.1:1", "transport": kind, **cfg})
        self.worker = WorkerSide(conf, node_id="reader", rank=0, expected_fingerprint=layout.fingerprint(),
                                 block_size=block, client_factory=_Master, kv_format=CPU,
                                 **({"max_model_len": NTOK + 24} if _HAS_MAX_LEN else {}))
        self.worker.register_kv_caches(as_cache(self.phys))
        self.finished: set[str] = set()

    def post(self, holder: Holder, rid: str, start: int, end: int, seed: int) -> list[int]:
        """Post the load of tokens [start, end) of the holder's sequence into fresh shuffled blocks
        (the reader had tokens [0, start) itself); returns the reader's block table."""
        table = [int(b) for b in np.random.default_rng(seed).permutation(self.nblocks)[: -(-end // self.block)]]
        hb, lb = holder.layout.block_size, self.block
        read = NodeRead(holder.node_id, tuple(holder.blocks[start // hb: -(-end // hb)]),
                        tuple(table[start // lb:]), hb, start // hb * hb, start // lb * lb, start, end - start)
        spec = LoadSpec(rid, f"lock-{rid}", end - start, (read,), time.time() + 60.0, tuple(table[start // lb:]))
        self.worker.start_loads(PdxferConnectorMetadata([spec], {holder.node_id: holder.ref(self.kind)}))
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


@pytest.mark.xfail(strict=True, reason="issue 16 hole 9: a load larger than staging fails with StagingFull")
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
