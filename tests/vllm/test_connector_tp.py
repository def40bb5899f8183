"""Tensor parallelism, namespaces and format conversion through both connector halves, without an
engine: a real master, vLLM's real BlockPool, one WorkerSide per TP rank with KV tensors in
vLLM's shapes, the real TCP transport. KV content is built logically (``[layers, K/V, blocks,
block_size, heads, head_dim]``) and encoded into each format and rank's head slice by permutes
(tests/kv_pattern.py), so what a reader ends up with is compared against the holder's logical KV,
not against pdxfer's own stride arithmetic.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from pdxfer.kv.heads import rank_heads  # noqa: E402
from pdxfer.kv.layout import CPU, CPU_AMX, FLASH_HND, FLASH_NHD, LayoutError  # noqa: E402
from pdxfer.master import MasterClient, NodeInfo  # noqa: E402
from pdxfer.contracts.connector_config import parse_extra_config  # noqa: E402
from pdxfer.vllm.metadata import HolderRef, LoadSpec, NodeRead, PdxferConnectorMetadata  # noqa: E402
from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402
from pdxfer.vllm.worker.worker_side import WorkerSide  # noqa: E402
from tests.kv_pattern import as_cache, decode, describe, encode  # noqa: E402
from tests.vllm.conftest import finish_request  # noqa: E402

C = 256
NB = 24  # blocks per engine
LAYERS = 2
HEADS = 4  # total KV heads of the "model"
HEAD_DIM = 16


def _logical(seed: int | None, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (LAYERS, 2, NB, block_size, HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


class Engine:
    """One vLLM instance's worth of connector state: a scheduler half, one worker half per TP
    rank (each with its head slice of the KV, in ``fmt``), a block pool."""

    def __init__(self, name: str, master_addr: str, *, producer: bool, consumer: bool, tp: int = 1,
                 fmt: str = CPU, block_size: int = 128, seed: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, **extra):
        self.name, self.tp, self.fmt, self.bs = name, tp, fmt, block_size
        logical = _logical(seed, block_size, dtype)
        self.phys: list[torch.Tensor] = []
        self.layouts = []
        for r in range(tp):
            hs = rank_heads(HEADS, tp, r)
            self.phys.append(encode(fmt, logical[:, :, :, :, hs.first:hs.end]))
            self.layouts.append(describe(fmt, self.phys[r], block_size))
        # No test here freezes a holder: generous read bounds, so a converting read on a loaded
        # box (0.69 s once, past the 0.5 s default floor) is not given up as a frozen holder's.
        self.cfg = parse_extra_config({"master": master_addr, "transport": "tcp", "publish_wait_s": 2.0,
                                       "read_timeout_floor_s": 10.0, "load_timeout_s": 20.0, **extra})
        self.pool = BlockPool(NB, True, block_size)
        lay0 = self.layouts[0]
        self.sched = SchedulerSide(self.cfg, engine_id=name, model_id="tiny", layout_fingerprint=lay0.fingerprint(),
                                   content_fingerprint=lay0.content_fingerprint(HEADS), total_kv_heads=HEADS,
                                   block_size=block_size, producer=producer, consumer=consumer, tp_size=tp)
        self.sched.bind_block_pool(self.pool)
        self.workers = [WorkerSide(self.cfg, node_id=name, rank=r, expected_fingerprint=lay0.fingerprint(),
                                   block_size=block_size, kv_format=fmt, tp_size=tp, total_kv_heads=HEADS)
                        for r in range(tp)]
        self.handshakes = [w.register_kv_caches(as_cache(p)) for w, p in zip(self.workers, self.phys)]
        self.sched.on_handshake(self.handshakes)

    def logical(self) -> torch.Tensor:
        """The engine's KV as ``[L, 2, NB, B, HEADS, D]``, gathered over its ranks."""
        return torch.cat([decode(self.fmt, p) for p in self.phys], dim=4)

    def tokens(self, ids: list[int], n: int) -> torch.Tensor:
        lg = self.logical()[:, :, ids]  # [L, 2, len(ids), B, H, D]
        return lg.reshape(LAYERS, 2, len(ids) * self.bs, HEADS, HEAD_DIM)[:, :, :n]

    def run_request(self, rid: str, tokens: list[int]) -> list[int]:
        return finish_request(self.sched, self.pool, self.bs, rid, tokens)[0]

    def load(self, rid: str, tokens: list[int], timeout: float = 15.0):
        """Scheduler + every worker (vLLM broadcasts the metadata to all TP ranks); the load is
        finished when every rank reported it. Returns (ext tokens, local ids, load errors)."""
        ext, _ = self.sched.get_num_new_matched_tokens(rid, tokens, len(tokens), 0, None)
        if ext == 0:
            return 0, [], set()
        blocks = self.pool.get_new_blocks(-(-len(tokens) // self.bs))
        ids = [b.block_id for b in blocks]
        self.sched.update_state_after_alloc(rid, ids, ext)
        meta = self.sched.build_connector_meta()
        return ext, ids, self.run_meta(meta, rid, timeout)

    def run_meta(self, meta: PdxferConnectorMetadata, rid: str, timeout: float = 15.0) -> set[int]:
        for w in self.workers:
            w.start_loads(meta)
        pending = set(range(self.tp))
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, f"load never finished on ranks {pending}"
            for r in list(pending):
                if rid in self.workers[r].get_finished():
                    pending.discard(r)
            time.sleep(0.005)
        errors: set[int] = set()
        for w in self.workers:
            errors |= w.take_load_errors()
        return errors

    def close(self) -> None:
        self.sched.close()
        for w in self.workers:
            w.close()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (n,), generator=g).tolist()




@pytest.fixture
def engines(master):
    made: list[Engine] = []

    def make(name: str, **kw) -> Engine:
        e = Engine(f"{name}{len(made)}", master.address, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _moved(holder: Engine, h_ids, reader: Engine, r_ids, n: int) -> bool:
    return torch.equal(holder.tokens(h_ids, n), reader.tokens(r_ids, n))


def test_tp2_holder_registers_one_node_with_both_endpoints(engines, master):
    holder = engines("p", producer=True, consumer=False, tp=2, seed=1)
    toks = _tokens(C + 10, 1)
    holder.run_request("p", toks)
    with MasterClient(master.address) as c:
        res = c.lookup_and_lock(holder.sched.namespace(None).chunk_hashes(toks), "probe")
        assert res.hit_chunks == 1 and [loc.node_id for loc in res.locations] == [holder.name]
        node = res.nodes[holder.name]
        assert (node.tp_size, node.total_kv_heads) == (2, HEADS)
        assert [ep.rank for ep in node.endpoints] == [0, 1]
        assert [ep.transport_metadata for ep in node.endpoints] == [h.transport_metadata for h in holder.handshakes]
        assert [ep.layout["kv_heads"] for ep in node.endpoints] == [2, 2]
        c.release(res.lock_id)
    hs = holder.handshakes[1]
    assert (hs.rank, hs.tp_size, hs.total_kv_heads, hs.dtype, hs.kv_format, hs.block_size) == (
        1, 2, HEADS, "bfloat16", CPU, 128)


def test_handshake_refuses_missing_ranks_and_other_content(engines, master):
    e = engines("p", producer=True, consumer=False, tp=2, seed=2)
    with pytest.raises(LayoutError, match=r"tensor_parallel_size 2, but its workers reported TP ranks \[0\]"):
        e.sched.on_handshake(e.handshakes[:1])
    other = Engine("fp16", master.address, producer=False, consumer=True, tp=2, dtype=torch.float16)
    try:
        with pytest.raises(LayoutError, match="reports KV layout cpu-float16.*derived cpu-bfloat16"):
            e.sched.on_handshake(other.handshakes)
    finally:
        other.close()


def test_tp1_reader_gathers_its_heads_from_both_holder_ranks(engines):
    holder = engines("p", producer=True, consumer=False, tp=2, seed=3)
    reader = engines("d", producer=False, consumer=True, tp=1)
    toks = _tokens(2 * C + 40, 3)
    h_ids = holder.run_request("p", toks)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _moved(holder, h_ids, reader, r_ids, ext)
    assert reader.workers[0].connected_holders() == [holder.name]
    assert sorted(reader.workers[0].peers.connections) == [(holder.name, 0), (holder.name, 1)]  # one connection per rank
    # CPU blocks are head-major: each rank's half is one byte range per block, read into place.
    assert {type(p[2]).__name__ for p in reader.workers[0].peers.connections.values()} == {"PeerPlanner"}
    assert reader.workers[0].stats.tokens_loaded == ext


def test_tp2_reader_ranks_each_read_their_slice_of_a_tp1_holder(engines):
    holder = engines("p", producer=True, consumer=False, tp=1, seed=4)
    reader = engines("d", producer=False, consumer=True, tp=2)
    toks = _tokens(C + 100, 4)
    h_ids = holder.run_request("p", toks)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _moved(holder, h_ids, reader, r_ids, ext)
    # Each rank read only its half of the heads; loads and tokens are counted once (rank 0).
    b0, b1 = (w.stats.bytes_loaded for w in reader.workers)
    assert b0 == b1 > 0
    assert [w.stats.tokens_loaded for w in reader.workers] == [ext, 0]


@pytest.mark.parametrize("holder_fmt, reader_fmt, hb, rb", [
    (FLASH_NHD, CPU, 128, 128),
    (CPU, FLASH_HND, 64, 128),
])
def test_other_format_holder_shares_the_namespace_and_converts(engines, holder_fmt, reader_fmt, hb, rb):
    holder = engines("p", producer=True, consumer=False, fmt=holder_fmt, block_size=hb, seed=5)
    reader = engines("d", producer=False, consumer=True, fmt=reader_fmt, block_size=rb)
    assert holder.sched.namespace(None).root() == reader.sched.namespace(None).root()
    assert holder.layouts[0].fingerprint() != reader.layouts[0].fingerprint()
    toks = _tokens(2 * C + 7, 5)
    h_ids = holder.run_request("p", toks)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _moved(holder, h_ids, reader, r_ids, ext)


def test_tp1_flash_reader_gathers_interleaved_heads_through_staging(engines):
    """Flash NHD interleaves heads per token: a TP1 reader of a TP2 flash holder stages each
    rank's blocks and scatters its heads into place."""
    holder = engines("p", producer=True, consumer=False, tp=2, fmt=FLASH_NHD, seed=10)
    reader = engines("d", producer=False, consumer=True, tp=1, fmt=FLASH_NHD)
    toks = _tokens(C + 130, 10)
    h_ids = holder.run_request("p", toks)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _moved(holder, h_ids, reader, r_ids, ext)
    assert {type(p[2]).__name__ for p in reader.workers[0].peers.connections.values()} == {"ConvertingPlanner"}


def test_tp2_flash_holder_to_tp2_cpu_reader(engines):
    """Same TP, other format: each rank reads its counterpart rank, converted."""
    holder = engines("p", producer=True, consumer=False, tp=2, fmt=FLASH_NHD, seed=6)
    reader = engines("d", producer=False, consumer=True, tp=2, fmt=CPU)
    toks = _tokens(C + 30, 6)
    h_ids = holder.run_request("p", toks)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _moved(holder, h_ids, reader, r_ids, ext)
    assert [sorted(w.peers.connections) for w in reader.workers] == [[(holder.name, 0)], [(holder.name, 1)]]


def _foreign_holder(master_addr: str, reader: Engine, node_id: str, toks: list[int], *, dtype: str = "float16",
                    fmt: str = CPU) -> None:
    """Register a holder in the reader's namespace whose KV is another dtype / format (what a
    misconfigured model_id would look like) and publish the prompt's chunks under it."""
    lay = reader.layouts[0]
    wire = dict(lay.to_wire(), dtype=dtype, kv_format=fmt)
    with MasterClient(master_addr) as c:
        c.register_node(NodeInfo(node_id, 0, "tcp", reader.handshakes[0].transport_metadata, wire,
                                 f"{fmt}-{dtype}-x", total_kv_heads=HEADS), lease_ttl_s=30.0)
        keys = reader.sched.namespace(None).chunk_hashes(toks)
        c.publish(node_id, [(k, [i]) for i, k in enumerate(keys)])


@pytest.mark.parametrize("dtype, fmt, said", [
    ("float16", CPU, "holds KV as float16, this reader as bfloat16"),
    ("bfloat16", CPU_AMX, "writes cpu_amx blocks .* this reader cpu"),
])
def test_unreadable_holder_is_skipped_and_logged_once_naming_both(engines, master, caplog, dtype, fmt, said):
    reader = engines("d", producer=False, consumer=True)
    toks = _tokens(2 * C + 3, 70 + len(fmt) + len(dtype))  # each case its own prompt
    _foreign_holder(master.address, reader, f"foreign-{fmt}-{dtype}", toks, dtype=dtype, fmt=fmt)
    with caplog.at_level(logging.WARNING, logger="pdxfer.vllm.scheduler"):
        assert reader.sched.get_num_new_matched_tokens("d1", toks, len(toks), 0, None) == (0, False)
        assert reader.sched.get_num_new_matched_tokens("d2", toks, len(toks), 0, None) == (0, False)
    lines = [r.getMessage() for r in caplog.records if "not reading from holder" in r.getMessage()]
    assert len(lines) == 1, lines
    import re
    assert re.search(said, lines[0]), lines[0]


def test_worker_refuses_a_dtype_mismatch_in_metadata_and_fails_the_load(engines, caplog):
    """Defence in depth: metadata naming a holder of another dtype (a scheduler that thought
    otherwise) fails the load (vLLM recomputes its blocks); no byte is read or written."""
    holder = engines("p", producer=True, consumer=False, seed=8, dtype=torch.float16)
    reader = engines("d", producer=False, consumer=True)
    ref = HolderRef.of(NodeInfo(holder.name, 0, "tcp", holder.handshakes[0].transport_metadata,
                                holder.handshakes[0].layout, holder.handshakes[0].layout_fingerprint))
    spec = LoadSpec("d", "lock-x", 128, (NodeRead(holder.name, (0,), (3,)),), time.time() + 30, (3,), holders=(ref,))
    before = reader.logical().clone()
    with caplog.at_level(logging.WARNING, logger="pdxfer.vllm.worker"):
        errors = reader.run_meta(PdxferConnectorMetadata([spec]), "d")
    assert errors == {3}
    assert any("holds KV as float16, this reader as bfloat16" in r.getMessage() for r in caplog.records)
    assert torch.equal(reader.logical(), before)
    assert reader.workers[0].connected_holders() == []


def test_one_dead_holder_rank_fails_the_whole_load(engines):
    """TP2 -> TP2 rank to rank: holder rank 1's KV server is gone. Reader rank 0 reads fine, rank 1
    fails: the request's blocks are load errors (vLLM takes the union over ranks and recomputes)."""
    holder = engines("p", producer=True, consumer=False, tp=2, seed=9)
    reader = engines("d", producer=False, consumer=True, tp=2)
    toks = _tokens(C + 60, 9)
    holder.run_request("p", toks)
    holder.workers[1].transport.close()
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == len(toks) - 1
    assert errors == set(r_ids[:3])
    assert reader.workers[0].stats.loads_ok == 1 and reader.workers[0].stats.loads_failed == 0
    assert reader.workers[1].stats.loads_failed == 1  # each rank counts its own failures
