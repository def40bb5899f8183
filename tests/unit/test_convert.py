"""Block-size conversion: holder blocks READ whole into staging, then scattered by token range.

The READ is played by plain memory copies of the plan's runs; the reference is token-level K
and V pulled out of both caches with vLLM-cpu's block layout (K transposed, then V)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdxfer.device import native
from pdxfer.planning.convert import ConvertingPlanner, StagingArea, check_convertible, planner_for
from pdxfer.kv.heads import head_sources, rank_heads
from pdxfer.kv.layout import CPU, CPU_AMX, FLASH_HND, FLASH_NHD, LayoutError, content_fingerprint, describe_kv_caches
from pdxfer.planning.peer_plan import PeerPlanner
from tests.kv_pattern import FORMATS, decode, describe, encode, layer_names, pattern_logical, play_plan
from tests.kv_pattern import raw as raw_buf

H, D, LAYERS = 2, 16, 3


def cpu_cache(num_blocks: int, block: int, seed: int | None) -> dict[str, torch.Tensor]:
    buf = torch.zeros(LAYERS, num_blocks, H, block, 2 * D, dtype=torch.float32)
    if seed is not None:
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
    return {f"l{i}": buf[i] for i in range(LAYERS)}


def tokens_kv(cache: dict[str, torch.Tensor], blocks: list[int], block: int, t0: int, t1: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] for tokens [t0, t1) of a sequence in ``blocks``."""
    out = []
    for name in sorted(cache):
        per_tok = []
        for t in range(t0, t1):
            b = cache[name][blocks[t // block]].reshape(H, 2 * block * D)
            k = b[:, : block * D].reshape(H, D, block)[:, :, t % block]
            v = b[:, block * D:].reshape(H, block, D)[:, t % block, :]
            per_tok.append(torch.stack([k, v]))
        out.append(torch.stack(per_tok, 1))
    return torch.stack(out)


def raw(t: torch.Tensor) -> native.RawBuffer:
    return native.RawBuffer(t.data_ptr(), t.untyped_storage().nbytes())


@pytest.mark.parametrize("hb,lb", [(128, 64), (64, 256), (256, 32), (32, 128)])
def test_staged_read_then_scatter_moves_exact_tokens(hb: int, lb: int):
    C = 256
    holder, reader = cpu_cache(40, hb, seed=1), cpu_cache(80, lb, seed=None)
    rl, ll = describe_kv_caches(holder, block_size=hb), describe_kv_caches(reader, block_size=lb)
    planner = ConvertingPlanner(rl, ll, staging_region=len(ll.regions))
    # The holder's request: 2 chunks and a 100-token tail in shuffled blocks; the reader's blocks too.
    n_tok = 2 * C + 100
    h_blocks = list(np.random.default_rng(1).permutation(40)[: -(-n_tok // hb)])
    l_blocks = [int(b) for b in np.random.default_rng(2).permutation(80)[: -(-n_tok // lb)]]
    start, end = 128, n_tok - 1  # the reader had 128 tokens locally; it computes the last one
    first_h = start // hb
    staging = torch.zeros(planner.staging_bytes(len(h_blocks) - first_h) + 8192, dtype=torch.uint8)
    job = planner.read([int(b) for b in h_blocks[first_h:]], first_h * hb, l_blocks[start // lb:],
                       start // lb * lb, start, end - start, staging_offset=4096)
    hbytes = holder["l0"].untyped_storage()
    hmem = torch.tensor([], dtype=torch.uint8).set_(hbytes)
    for r in job.plan.runs:  # what the transport would do
        staging[r.local_offset: r.local_offset + r.nbytes] = hmem[r.remote_offset: r.remote_offset + r.nbytes]
    planner.scatter(job, raw(staging), [raw(reader["l0"])])
    assert torch.equal(tokens_kv(reader, l_blocks, lb, start, end), tokens_kv(holder, h_blocks, hb, start, end))
    # Nothing outside the range was written: the reader's token 'end' and tokens before 'start' stay zero.
    assert not tokens_kv(reader, l_blocks, lb, 0, start).any()
    if end % lb:
        assert not tokens_kv(reader, l_blocks, lb, end, end + 1).any()


def test_converting_planner_refuses_what_differs_beyond_block_size():
    a = describe_kv_caches(cpu_cache(4, 64, None), block_size=64)
    other = {k: v.to(torch.bfloat16) for k, v in cpu_cache(4, 128, None).items()}
    with pytest.raises(LayoutError, match=r"holder has .*bfloat16.* this reader .*float32"):
        ConvertingPlanner(describe_kv_caches(other, block_size=128), a, staging_region=1)


def test_staging_area_first_fit_and_free():
    s = StagingArea(16384, align=4096)
    a, b = s.alloc(5000), s.alloc(4096)
    assert (a, b) == (0, 8192)
    assert s.alloc(8192) is None  # 4096 left
    s.free(a)
    assert s.alloc(8192) == 0 and s.in_use == 8192 + 4096


# --------------------------------------------------------------------------- formats and head slices



DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cache(fmt: str, logical: torch.Tensor, block: int):
    phys = encode(fmt, logical)
    return phys, describe(fmt, phys, block)


@st.composite
def convert_case(draw):
    hr, hl = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n = draw(st.integers(1, min(hr, hl)))
    hb, lb = draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([1, 4, 8, 16]))
    n_seq = draw(st.integers(1, 70))
    start = draw(st.integers(0, n_seq - 1))
    return dict(src=draw(st.sampled_from(FORMATS)), dst=draw(st.sampled_from(FORMATS)), hb=hb, lb=lb,
                hr=hr, hl=hl, nheads=n, src_head=draw(st.integers(0, hr - n)), dst_head=draw(st.integers(0, hl - n)),
                dim=draw(st.sampled_from([2, 8])), dtype=draw(st.sampled_from(sorted(DTYPES))),
                n_seq=n_seq, start=start, ntok=draw(st.integers(1, n_seq - start)),
                first_h=draw(st.integers(0, start // hb)), first_l=draw(st.integers(0, start // lb)),
                stage_at=8 * draw(st.integers(0, 64)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=convert_case())
def test_planner_moves_exactly_the_token_range_and_head_slice_between_any_formats(c):
    """Random formats, block sizes (either way), head slices, token starts and partial edge blocks:
    the reader's logical KV afterwards equals a plain-indexing reference, bit for bit, and nothing
    outside the range or the head slice changed."""
    g = torch.Generator().manual_seed(c["seed"])
    dtype, layers, d = DTYPES[c["dtype"]], 2, c["dim"]
    hb, lb, end = c["hb"], c["lb"], c["start"] + c["ntok"]
    h_nb, l_nb = -(-c["n_seq"] // hb) + 3, -(-c["n_seq"] // lb) + 3
    h_blocks = [int(b) for b in torch.randperm(h_nb, generator=g)[: -(-c["n_seq"] // hb)]]
    l_blocks = [int(b) for b in torch.randperm(l_nb, generator=g)[: -(-c["n_seq"] // lb)]]
    hold = torch.randn(layers, 2, h_nb, hb, c["hr"], d, generator=g).to(dtype)
    mine = torch.randn(layers, 2, l_nb, lb, c["hl"], d, generator=g).to(dtype)
    h_phys, rl = _cache(c["src"], hold, hb)  # h_phys keeps the holder memory the plan reads alive
    l_phys, ll = _cache(c["dst"], mine, lb)
    planner = ConvertingPlanner(rl, ll, staging_region=len(ll.regions), src_head=c["src_head"],
                                dst_head=c["dst_head"], nheads=c["nheads"])
    remote = h_blocks[c["first_h"]: -(-end // hb)]
    local = l_blocks[c["first_l"]:]
    job = planner.read(remote, c["first_h"] * hb, local, c["first_l"] * lb, c["start"], c["ntok"],
                       staging_offset=c["stage_at"])
    assert job.staging_bytes == planner.staging_bytes(len(remote))
    staging = np.zeros(c["stage_at"] + job.staging_bytes, dtype=np.uint8)
    play_plan(job.plan, rl, {len(ll.regions): staging})
    planner.scatter(job, native.RawBuffer(staging.ctypes.data, staging.nbytes), [raw_buf(l_phys)])
    del h_phys

    want = mine.clone()
    t = torch.arange(c["start"], end)
    lb_idx = torch.as_tensor(l_blocks)[t // lb]
    hb_idx = torch.as_tensor(h_blocks)[t // hb]
    sh, dh, n = c["src_head"], c["dst_head"], c["nheads"]
    want[:, :, lb_idx, t % lb, dh:dh + n] = hold[:, :, hb_idx, t % hb, sh:sh + n]
    bits = decode(c["dst"], l_phys).contiguous().view(torch.uint8)
    assert torch.equal(bits, want.contiguous().view(torch.uint8))


def test_staging_holds_only_the_head_slice_for_head_major_holders():
    # cpu and flash_hnd keep a head's bytes together: half the heads, half the staged bytes;
    # flash_nhd interleaves heads per token, so its whole blocks are staged.
    for fmt, want_half in ((CPU, True), (FLASH_HND, True), (FLASH_NHD, False)):
        _, rl = _cache(fmt, torch.zeros(2, 2, 4, 16, 4, 8), 16)
        _, ll = _cache(FLASH_NHD, torch.zeros(2, 2, 4, 16, 2, 8), 16)
        whole = sum(s.block_bytes for s in rl.segments)
        p = ConvertingPlanner(rl, ll, 1, src_head=2, dst_head=0, nheads=2)
        assert p.staging_bytes(1) == (whole // 2 if want_half else whole), fmt
        job = p.read([1, 2], 0, [0, 1], 0, 0, 20, staging_offset=0)
        assert job.plan.total_bytes == p.staging_bytes(2)


def test_tp2_holder_ranks_gather_into_a_tp1_reader_in_process():
    # Holder TP 2 (flash_hnd, 2 of 4 heads per rank, block 16) -> reader TP 1 (cpu, block 8).
    H, hb, lb, ntok = 4, 16, 8, 40
    h_blocks, l_blocks = [3, 0, 2], [5, 1, 4, 0, 2]
    ranks = []
    for r in range(2):
        sl = rank_heads(H, 2, r)
        log = pattern_logical(2, h_blocks, 4, hb, sl.first, sl.count, H, 8, ntok)
        ranks.append(_cache(FLASH_HND, log, hb))
    l_phys, ll = _cache(CPU, torch.zeros(2, 2, 6, lb, H, 8), lb)
    for src in head_sources(H, 2, 1, 0):
        _, rl = ranks[src.holder_rank]  # `ranks` keeps each holder's memory alive
        p = ConvertingPlanner(rl, ll, 1, src_head=src.src_head, dst_head=src.dst_head, nheads=src.nheads)
        job = p.read(h_blocks, 0, l_blocks, 0, 0, ntok, staging_offset=0)
        staging = np.zeros(job.staging_bytes, dtype=np.uint8)
        play_plan(job.plan, rl, {1: staging})
        p.scatter(job, native.RawBuffer(staging.ctypes.data, staging.nbytes), [raw_buf(l_phys)])
    want = pattern_logical(2, l_blocks, 6, lb, 0, H, H, 8, ntok, filler=0.0)
    assert torch.equal(decode(CPU, l_phys), want)


def test_check_convertible_names_both_sides():
    _, a = _cache(FLASH_HND, torch.zeros(2, 2, 4, 16, 8, 8, dtype=torch.bfloat16), 16)
    _, b = _cache(CPU, torch.zeros(2, 2, 4, 32, 8, 8), 32)
    with pytest.raises(LayoutError, match=r"dtypes differ.*holder has dtype bfloat16 \(flash_hnd, 8 kv heads.*"
                                          r"this reader dtype float32 \(cpu, 8 kv heads"):
        check_convertible(a, b)
    _, c = _cache(CPU, torch.zeros(2, 2, 4, 32, 8, 4), 32)
    with pytest.raises(LayoutError, match=r"head_dim differs.*head_dim 8.*head_dim 4"):
        check_convertible(b, c)
    _, three = _cache(CPU, torch.zeros(3, 2, 4, 32, 8, 8), 32)
    with pytest.raises(LayoutError, match="layer names differ"):
        check_convertible(three, b)
    amx = describe_kv_caches({n: t for n, t in zip(layer_names(2), encode(CPU, torch.zeros(2, 2, 4, 32, 8, 8)))},
                             block_size=32, kv_format=CPU_AMX)
    with pytest.raises(LayoutError, match="cpu_amx .*no known block geometry.*holder has dtype float32 "
                                          r"\(cpu_amx"):
        check_convertible(amx, b)
    with pytest.raises(LayoutError, match="cpu_amx"):
        ConvertingPlanner(b, amx, 1)
    # Other formats, block sizes and head counts are convertible.
    _, d = _cache(FLASH_NHD, torch.zeros(2, 2, 4, 64, 2, 8), 64)
    check_convertible(b, d)
    with pytest.raises(LayoutError, match="pass src_head, dst_head and nheads"):
        ConvertingPlanner(b, d, 1)
    with pytest.raises(LayoutError, match=r"heads \[1, 3\) are outside the 2 kv heads of the reader"):
        ConvertingPlanner(b, d, 1, src_head=0, dst_head=1, nheads=2)


def test_content_fingerprint_ignores_format_block_size_and_tp_only():
    _, full = _cache(CPU, torch.zeros(2, 2, 4, 32, 8, 8), 32)
    _, rank = _cache(FLASH_HND, torch.zeros(2, 2, 4, 16, 4, 8), 16)  # TP 2 share
    _, mqa = _cache(FLASH_NHD, torch.zeros(2, 2, 4, 16, 1, 8), 16)  # a replicated head
    fp = content_fingerprint("float32", 2, 8, 8)
    assert full.content_fingerprint(8) == rank.content_fingerprint(8) == mqa.content_fingerprint(8) == fp
    assert full.fingerprint() != rank.fingerprint()  # the byte format differs
    others = {content_fingerprint("bfloat16", 2, 8, 8), content_fingerprint("float32", 3, 8, 8),
              content_fingerprint("float32", 2, 4, 8), content_fingerprint("float32", 2, 8, 16)}
    assert fp not in others and len(others) == 4
    with pytest.raises(LayoutError, match="cannot be a TP share"):
        rank.content_fingerprint(6)


# --------------------------------------------------------------------------- direct head slices



@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from([CPU, FLASH_HND]), block=st.sampled_from([1, 4, 16]), hr=st.integers(1, 4),
       hl=st.integers(1, 4), data=st.data())
def test_peer_planner_reads_a_head_slice_straight_into_place(fmt, block, hr, hl, data):
    n = data.draw(st.integers(1, min(hr, hl)))
    sh, dh = data.draw(st.integers(0, hr - n)), data.draw(st.integers(0, hl - n))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    hold, mine = torch.randn(2, 2, 6, block, hr, 4, generator=g), torch.randn(2, 2, 7, block, hl, 4, generator=g)
    h_phys, rl = _cache(fmt, hold, block)  # h_phys keeps the holder memory the plan reads alive
    l_phys, ll = _cache(fmt, mine, block)
    rb, lb = [4, 5, 0, 2], [1, 2, 3, 6]
    p = PeerPlanner(rl, ll, src_head=sh, dst_head=dh, nheads=n)
    plan = p.plan(rb, lb)
    play_plan(plan, rl, {0: np.frombuffer(memoryview(l_phys.numpy()).cast("B"), dtype=np.uint8)})
    del h_phys
    want = mine.clone()
    want[:, :, lb, :, dh:dh + n] = hold[:, :, rb, :, sh:sh + n]
    assert torch.equal(decode(fmt, l_phys), want)
    assert plan.total_bytes == len(rb) * 2 * 2 * n * block * 4 * 4  # only the slice moves


def test_planner_for_reads_straight_where_it_can_and_stages_elsewhere():
    _, cpu4 = _cache(CPU, torch.zeros(2, 2, 4, 16, 4, 8), 16)
    _, cpu2 = _cache(CPU, torch.zeros(2, 2, 4, 16, 2, 8), 16)
    _, cpu2_32 = _cache(CPU, torch.zeros(2, 2, 4, 32, 2, 8), 32)
    _, nhd2 = _cache(FLASH_NHD, torch.zeros(2, 2, 4, 16, 2, 8), 16)
    _, nhd4 = _cache(FLASH_NHD, torch.zeros(2, 2, 4, 16, 4, 8), 16)
    assert type(planner_for(cpu4, cpu4, 1)) is PeerPlanner
    assert type(planner_for(cpu4, cpu2, 1, src_head=2, nheads=2)) is PeerPlanner  # head-major: a byte range
    assert type(planner_for(cpu4, cpu2_32, 1, src_head=2, nheads=2)) is ConvertingPlanner  # block size
    assert type(planner_for(nhd4, nhd2, 1, src_head=2, nheads=2)) is ConvertingPlanner  # NHD interleaves heads
    assert type(planner_for(cpu4, nhd4, 1)) is ConvertingPlanner  # format
    with pytest.raises(LayoutError, match="no staging area"):
        planner_for(cpu4, nhd4, None)
    with pytest.raises(LayoutError, match="head-major"):
        PeerPlanner(nhd4, nhd2, src_head=0, nheads=2)


def test_read_pairs_converts_block_for_block_at_equal_block_size():
    g = torch.Generator().manual_seed(3)
    hold, mine = torch.randn(2, 2, 5, 8, 2, 4, generator=g), torch.randn(2, 2, 6, 8, 2, 4, generator=g)
    h_phys, rl = _cache(FLASH_NHD, hold, 8)
    l_phys, ll = _cache(CPU, mine, 8)
    p = planner_for(rl, ll, 1)
    assert type(p) is ConvertingPlanner
    rb, lb = [4, 0, 2], [1, 5, 3]
    job = p.read_pairs(rb, lb, staging_offset=0)
    staging = np.zeros(job.staging_bytes, dtype=np.uint8)
    play_plan(job.plan, rl, {1: staging})
    p.scatter(job, native.RawBuffer(staging.ctypes.data, staging.nbytes), [raw_buf(l_phys)])
    del h_phys
    want = mine.clone()
    want[:, :, lb] = hold[:, :, rb]
    assert torch.equal(decode(CPU, l_phys), want)
    _, other = _cache(CPU, torch.zeros(2, 2, 6, 16, 2, 4), 16)
    with pytest.raises(LayoutError, match="equal block sizes"):
        ConvertingPlanner(rl, other, 1).read_pairs(rb, lb, 0)
