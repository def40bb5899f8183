"""Layout conversion and TP head slices over real transports, holder and reader in separate processes.

Each holder process (``kv_peer``) registers real KV tensors in one vLLM format, filled with a known
value per (layer, K/V, token, model head, dim) for its TP rank's heads; this process is the reader:
KV tensors in another format and block size plus a registered staging area, a
``ConvertingPlanner`` per holder rank (``pdxfer.kv.heads.head_sources`` says which heads come from
where), a real READ into staging, the native scatter, then every reader element is compared with
the value it must hold, and the tokens it did not read must still hold the filler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdxfer.device import native
from pdxfer.planning.convert import ConvertingPlanner, planner_for
from pdxfer.kv.heads import HeadSource, head_sources, rank_heads
from pdxfer.kv.layout import BLOCKS_FIRST_NHD, CPU, FLASH_HND, FLASH_NHD, KVLayout
from pdxfer.planning.peer_plan import PeerPlanner
from pdxfer.transport import create_transport
from pdxfer.transport.base import ReadState, RegisteredRegion
from tests.kv_pattern import decode, describe, encode, pattern_logical

from .conftest import REPO, _opt_args, child_env, read_line, transport_options

LAYERS, D = 2, 8
NTOK = 100  # the holder's sequence
START, END = 32, NTOK - 1  # the reader had [0, 32) already and computes the last token itself
WAIT = 20.0
FILLER = -2.0


def _nblocks(block: int) -> int:
    return -(-NTOK // block) + 3  # a few blocks the sequence does not use


def _seq_blocks(block: int, seed: int) -> list[int]:
    """Shuffled block ids for the sequence: no test may rely on consecutive blocks."""
    return [int(b) for b in np.random.default_rng(seed).permutation(_nblocks(block))[: -(-NTOK // block)]]


@dataclass
class KVHolder:
    meta: bytes
    layout: KVLayout
    blocks: list[int]
    seed: int = 0  # its pattern seed (tests.kv_pattern)


@pytest.fixture
def start_kv_holder(procs):
    def start(kind: str, fmt: str, block: int, total_heads: int, tp: int = 1, rank: int = 0,
              seed: int = 0) -> KVHolder:
        blocks = _seq_blocks(block, seed=100 + 10 * block)  # one block table for all TP ranks, as in vLLM
        args = ["--kind", kind, "--format", fmt, "--block", str(block), "--num-blocks", str(_nblocks(block)),
                "--layers", str(LAYERS), "--total-heads", str(total_heads), "--tp", str(tp), "--rank", str(rank),
                "--head-dim", str(D), "--ntokens", str(NTOK), "--blocks", ",".join(map(str, blocks)),
                "--seed", str(seed), *_opt_args(transport_options(kind))]
        proc = subprocess.Popen([sys.executable, "-m", "tests.transport.kv_peer", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
        procs.append(proc)
        _, meta, layout = read_line(proc, "META ", 60.0).split(" ", 2)
        return KVHolder(bytes.fromhex(meta), KVLayout.from_wire(json.loads(layout)), blocks, seed)

    return start


class KVReader:
    """One reader TP rank in this process: KV tensors, a staging area, a real transport."""

    STAGING = 1 << 20

    def __init__(self, kind: str, fmt: str, block: int, total_heads: int, tp: int = 1, rank: int = 0) -> None:
        self.fmt, self.block, self.total_heads = fmt, block, total_heads
        self.heads = rank_heads(total_heads, tp, rank)
        self.blocks = _seq_blocks(block, seed=7)
        self.phys = encode(fmt, torch.full((LAYERS, 2, _nblocks(block), block, self.heads.count, D), FILLER))
        self.layout = describe(fmt, self.phys, block)
        self.staging = np.zeros(self.STAGING, dtype=np.uint8)
        self.staging_region = len(self.layout.regions)
        self.t = create_transport(kind, **transport_options(kind))
        self.t.register([RegisteredRegion(r.index, r.ptr, r.nbytes) for r in self.layout.regions]
                        + [RegisteredRegion(self.staging_region, self.staging.ctypes.data, self.staging.nbytes)])
        self._peers: dict[bytes, str] = {}

    def load(self, holder: KVHolder, src: HeadSource | None = None) -> None:
        """Tokens [START, END) from one holder rank: plan, READ into staging, scatter."""
        if holder.meta not in self._peers:
            self._peers[holder.meta] = self.t.connect(holder.meta, timeout=WAIT)
        heads = {} if src is None else dict(src_head=src.src_head, dst_head=src.dst_head, nheads=src.nheads)
        planner = ConvertingPlanner(holder.layout, self.layout, self.staging_region, **heads)
        hb, lb = holder.layout.block_size, self.block
        job = planner.read(holder.blocks[START // hb: -(-END // hb)], START // hb * hb,
                           self.blocks[START // lb: -(-END // lb)], START // lb * lb, START, END - START,
                           staging_offset=0)
        assert job.staging_bytes <= self.STAGING
        assert self.t.read(self._peers[holder.meta], job.plan).wait(WAIT) is ReadState.DONE
        planner.scatter(job, native.RawBuffer(self.staging.ctypes.data, self.staging.nbytes),
                        [native.RawBuffer(r.ptr, r.nbytes) for r in self.layout.regions])

    def load_direct(self, holder: KVHolder, src: HeadSource) -> None:
        """Whole blocks [START, END) rounded out, head slice straight into place (no staging)."""
        planner = planner_for(holder.layout, self.layout, self.staging_region, src_head=src.src_head,
                              dst_head=src.dst_head, nheads=src.nheads)
        assert type(planner) is PeerPlanner
        peer = self.t.connect(holder.meta, timeout=WAIT)
        b = self.block
        plan = planner.plan(holder.blocks[START // b: -(-END // b)], self.blocks[START // b: -(-END // b)])
        assert plan.total_bytes == len(plan.runs) * plan.runs[0].nbytes  # slices of blocks, no more
        assert self.t.read(peer, plan).wait(WAIT) is ReadState.DONE

    def check(self, whole_blocks: bool = False, seed: int = 0) -> None:
        """Tokens [START, END) hold the pattern of holder ``seed``, earlier ones the filler;
        ``whole_blocks``: the last block came whole, so tokens [END, NTOK) hold the pattern and the
        rest the holder's -1."""
        got = decode(self.fmt, self.phys)
        want = pattern_logical(LAYERS, self.blocks, _nblocks(self.block), self.block, self.heads.first,
                               self.heads.count, self.total_heads, D, NTOK if whole_blocks else END, filler=FILLER,
                               seed=seed)
        seq = torch.as_tensor(self.blocks)
        before = torch.arange(START)
        want[:, :, seq[before // self.block], before % self.block] = FILLER
        if whole_blocks:
            pad = torch.arange(NTOK, -(-NTOK // self.block) * self.block)
            want[:, :, seq[pad // self.block], pad % self.block] = -1.0
        bad = (got != want).nonzero()
        assert len(bad) == 0, (f"{len(bad)} wrong elements; first [layer, K/V, block, slot, head, dim] = "
                               f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}")

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def make_reader():
    made: list[KVReader] = []

    def make(*args, **kw) -> KVReader:
        r = KVReader(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("src_fmt,src_block,dst_fmt,dst_block", [
    (FLASH_NHD, 16, FLASH_HND, 16),
    (FLASH_HND, 32, FLASH_NHD, 8),
    (CPU, 16, FLASH_NHD, 64),
    (FLASH_NHD, 32, CPU, 16),
    (CPU, 8, FLASH_HND, 32),
    (FLASH_HND, 16, CPU, 16),
    (BLOCKS_FIRST_NHD, 16, CPU, 32),
])
def test_format_conversion_exact(kind, start_kv_holder, make_reader, src_fmt, src_block, dst_fmt, dst_block):
    holder = start_kv_holder(kind, src_fmt, src_block, total_heads=4)
    reader = make_reader(kind, dst_fmt, dst_block, total_heads=4)
    reader.load(holder)
    reader.check()


def test_tp2_holder_to_tp1_reader_gathers_from_both_ranks(kind, start_kv_holder, make_reader):
    holders = [start_kv_holder(kind, FLASH_HND, 16, total_heads=4, tp=2, rank=r) for r in range(2)]
    assert holders[0].layout.kv_heads == 2
    reader = make_reader(kind, CPU, 32, total_heads=4)
    sources = head_sources(4, holder_tp=2, reader_tp=1, reader_rank=0)
    assert sorted(s.holder_rank for s in sources) == [0, 1]
    for s in sources:
        reader.load(holders[s.holder_rank], s)
    reader.check()


@pytest.mark.parametrize("holder_fmt", [CPU, FLASH_NHD])  # head slice staged alone / whole blocks staged
def test_tp1_holder_to_tp2_readers_each_read_their_slice(kind, start_kv_holder, make_reader, holder_fmt):
    holder = start_kv_holder(kind, holder_fmt, 16, total_heads=4)
    for rank in range(2):
        reader = make_reader(kind, FLASH_NHD, 32, total_heads=4, tp=2, rank=rank)
        (s,) = head_sources(4, holder_tp=1, reader_tp=2, reader_rank=rank)
        assert (s.src_head, s.nheads) == (2 * rank, 2)
        reader.load(holder, s)
        reader.check()


def test_mqa_replicated_head_tp2_to_tp2(kind, start_kv_holder, make_reader):
    # One KV head, TP 2 on both sides: each holder rank holds a copy; each reader takes its own.
    # The copies get different values (a seed per rank): a read from the other rank would show.
    holders = [start_kv_holder(kind, FLASH_NHD, 16, total_heads=1, tp=2, rank=r, seed=r + 1) for r in range(2)]
    used = []
    for rank in range(2):
        reader = make_reader(kind, FLASH_HND, 32, total_heads=1, tp=2, rank=rank)
        (s,) = head_sources(1, holder_tp=2, reader_tp=2, reader_rank=rank)
        used.append(s.holder_rank)
        reader.load(holders[s.holder_rank], s)
        reader.check(seed=holders[rank].seed)
    assert used == [0, 1]


@pytest.mark.parametrize("fmt", [CPU, FLASH_HND])
def test_tp2_holders_to_tp1_reader_direct_head_slices(kind, start_kv_holder, make_reader, fmt):
    # Same head-major format and block size: each holder rank's heads are one byte range per
    # block, READ straight into the right heads of the reader's blocks.
    holders = [start_kv_holder(kind, fmt, 16, total_heads=4, tp=2, rank=r) for r in range(2)]
    reader = make_reader(kind, fmt, 16, total_heads=4)
    for s in head_sources(4, holder_tp=2, reader_tp=1, reader_rank=0):
        reader.load_direct(holders[s.holder_rank], s)
    reader.check(whole_blocks=True)
