"""The reader's staging area: first-fit reservations shared by concurrent converting loads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pdxfer.planning.convert import StagingArea
from pdxfer.device import CpuStandIn
from pdxfer.kv.layout import BLOCKS_FIRST_NHD, CPU, FLASH_HND, FLASH_NHD, describe_kv_caches
from pdxfer.contracts.connector_config import ConnectorConfigError, parse_extra_config
from pdxfer.vllm.metadata import NodeRead
from pdxfer.vllm.worker.staging import ReaderStaging, auto_staging_bytes, region_tensors
from tests.kv_pattern import describe, encode, play_plan
from tests.unit.test_convert import cpu_cache, tokens_kv


def test_an_empty_allocation_is_refused_and_keeps_other_reservations():
    s = StagingArea(16384, align=4096)
    assert s.alloc(4096) == 0
    for size in (0, -1):
        with pytest.raises(ValueError, match="size"):
            s.alloc(size)
    assert s.in_use == 4096
    assert s.alloc(4096) == 4096  # the load at offset 0 still owns its range


def test_an_empty_staged_read_reserves_nothing_and_frees_nothing():
    holder = describe_kv_caches(cpu_cache(8, 128, None), block_size=128)
    staging = ReaderStaging(1 << 20, describe_kv_caches(cpu_cache(8, 64, None), block_size=64))
    route = type("Route", (), {"src_head": 0, "dst_head": 0, "nheads": None})()
    planner = staging.planner_for(holder, route)
    first = staging.next_piece(staging.stream(planner, NodeRead("h", (1, 2), (0, 1, 2, 3), 128, 0, 0, 0, 200), "p"))
    held = staging.area.in_use
    assert held >= first.staging_bytes > 0
    with pytest.raises(ValueError):
        staging.stream(planner, NodeRead("h", (), (), 128, 0, 0, 0, 0), "p")
    assert staging.area.in_use == held  # the first load's range is still reserved
    with pytest.raises(ValueError):
        staging.stream(planner, NodeRead("h", (), ()), "p")
    assert staging.area.in_use == held
    assert staging.area.alloc(4096) == -(-first.staging_bytes // 4096) * 4096


def test_alloc_upto_takes_the_largest_gap_and_as_many_units_as_fit():
    s = StagingArea(10 * 4096, align=4096)
    a, b = s.alloc(4096), s.alloc(3 * 4096)
    s.free(a)  # gaps: [0, 4096) and [16384, 40960)
    assert s.alloc_upto(4096, 100) == (4 * 4096, 6)
    assert s.alloc_upto(4096, 1) == (0, 1)
    assert s.alloc_upto(4096, 1) is None  # full
    s.free(b)
    assert s.alloc_upto(5000, 3) == (4096, 2)  # three units of 5000 need 16384 aligned bytes, the gap has 12288
    with pytest.raises(ValueError):
        s.alloc_upto(0, 1)


def test_auto_staging_holds_a_max_length_load_within_the_cap():
    layout = describe_kv_caches(cpu_cache(8, 64, None), block_size=64)
    per_token = layout.bytes_per_block // 64
    got = auto_staging_bytes(layout, layout.kv_heads, 32768, cap_mib=1 << 14)
    assert got >= per_token * 32768 and got % (1 << 20) == 0
    # A TP rank with half of the model's heads may stage whole blocks carrying all of them.
    assert auto_staging_bytes(layout, 2 * layout.kv_heads, 32768, cap_mib=1 << 14) >= 2 * per_token * 32768
    assert auto_staging_bytes(layout, layout.kv_heads, 32768, cap_mib=8) == 8 << 20
    assert auto_staging_bytes(layout, layout.kv_heads, 10, cap_mib=0) == 0


def test_staging_mib_is_auto_by_default_and_an_explicit_size_still_works():
    auto = parse_extra_config({"master": "m:1"})
    assert auto.staging_mib is None and auto.staging_enabled
    assert parse_extra_config({"master": "m:1", "staging_mib": "auto"}).staging_mib is None
    assert parse_extra_config({"master": "m:1", "staging_mib": 48}).staging_mib == 48
    assert not parse_extra_config({"master": "m:1", "staging_mib": 0}).staging_enabled
    assert not parse_extra_config({"master": "m:1", "staging_max_mib": 0}).staging_enabled
    with pytest.raises(ConnectorConfigError, match="staging_mib"):
        parse_extra_config({"master": "m:1", "staging_mib": "big"})
    with pytest.raises(ConnectorConfigError, match="staging_max_mib"):
        parse_extra_config({"master": "m:1", "staging_max_mib": -1})


@pytest.mark.parametrize("hb,lb,start,end", [(128, 32, 40, 999), (32, 128, 1, 640), (64, 16, 64, 700),
                                             (256, 48, 300, 301)])
@pytest.mark.parametrize("area_blocks", [1, 3, 100])
def test_a_stream_moves_exact_tokens_piece_by_piece(hb, lb, start, end, area_blocks):
    """Pieces of at most half the area (once the whole read does not fit), each READ (played as
    memory copies) and scattered before the next: every reader element ends up right."""
    holder_kv, reader_kv = cpu_cache(40, hb, seed=3), cpu_cache(80, lb, seed=None)
    rl, ll = describe_kv_caches(holder_kv, block_size=hb), describe_kv_caches(reader_kv, block_size=lb)
    unit = rl.bytes_per_block
    staging = ReaderStaging(area_blocks * -(-unit // 4096) * 4096, ll)
    route = type("Route", (), {"src_head": 0, "dst_head": 0, "nheads": None})()
    planner = staging.planner_for(rl, route)
    h_blocks = [int(b) for b in np.random.default_rng(1).permutation(40)[: -(-end // hb)]]
    l_blocks = [int(b) for b in np.random.default_rng(2).permutation(80)[: -(-end // lb)]]
    r = NodeRead("h", tuple(h_blocks[start // hb:]), tuple(l_blocks[start // lb:]), hb, start // hb * hb,
                 start // lb * lb, start, end - start)
    s = staging.stream(planner, r, "peer")
    mem = staging._mem
    while not s.finished:
        job = staging.next_piece(s)
        assert job is not None and job.staging_offset + job.staging_bytes <= mem.nbytes
        play_plan(job.plan, rl, {staging.region_index: mem})
        staging.scatter(s)
    assert staging.area.in_use == 0
    assert (s.pieces == 1) == (area_blocks >= s.end - s.first)  # streamed only when it does not fit
    assert torch.equal(tokens_kv(reader_kv, l_blocks, lb, start, end), tokens_kv(holder_kv, h_blocks, hb, start, end))
    assert not tokens_kv(reader_kv, l_blocks, lb, 0, start).any()
    if end % lb:
        assert not tokens_kv(reader_kv, l_blocks, lb, end, -(-end // lb) * lb).any()


# --------------------------------------------------------------------------- device operations

def _route(src_head: int, dst_head: int, nheads: int | None):
    return type("Route", (), {"src_head": src_head, "dst_head": dst_head, "nheads": nheads})()


def _run_stream(staging: ReaderStaging, holder_layout, planner, read) -> int:
    """Every piece of ``read`` READ (played as copies) and scattered; waits for each scatter's
    event (bounded) before the next piece. Returns how many scatters were still running when
    ``scatter`` returned."""
    s = staging.stream(planner, read, "peer")
    late = 0
    while not s.finished:
        job = staging.next_piece(s)
        play_plan(job.plan, holder_layout, {staging.region_index: staging._mem})
        if not staging.scatter(s):
            late += 1
            assert s.scatter_event.wait(5.0), "a stand-in scatter never completed"
            staging.finish_scatter(s)
    return late


# (holder format, reader format, holder block, reader block, holder heads, reader heads, nheads,
#  src_head, dst_head): block size, format and head-slice conversions, whole or in pieces.
CASES = [(CPU, CPU, 16, 8, 2, 2, None, 0, 0), (CPU, FLASH_NHD, 8, 16, 2, 2, None, 0, 0),
         (FLASH_HND, CPU, 16, 16, 4, 2, 2, 2, 0), (FLASH_NHD, BLOCKS_FIRST_NHD, 4, 8, 2, 4, 2, 0, 1),
         (BLOCKS_FIRST_NHD, FLASH_HND, 8, 8, 2, 2, None, 0, 0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[2]}-{c[1]}{c[3]}-h{c[6]}")
def test_device_scatter_enqueues_exactly_what_the_planner_scatters(case):
    """The runs the worker enqueues on its stream (async stand-in) give the reader, bit for bit,
    what ConvertingPlanner.scatter gives it inline; and only after the event."""
    src_fmt, dst_fmt, hb, lb, hr, hl, nheads, sh, dh = case
    g = torch.Generator().manual_seed(hb * 31 + lb)
    n_seq, start = 61, 5
    h_nb, l_nb = -(-n_seq // hb) + 2, -(-n_seq // lb) + 2
    hold = encode(src_fmt, torch.randn(2, 2, h_nb, hb, hr, 8, generator=g))
    init = torch.randn(2, 2, l_nb, lb, hl, 8, generator=g)
    rl = describe(src_fmt, hold, hb)
    h_blocks = [int(b) for b in torch.randperm(h_nb, generator=g)[: -(-n_seq // hb)]]
    l_blocks = [int(b) for b in torch.randperm(l_nb, generator=g)[: -(-n_seq // lb)]]
    if hb == lb:  # block for block
        read = NodeRead("h", tuple(h_blocks), tuple(l_blocks))
    else:
        read = NodeRead("h", tuple(h_blocks[start // hb:]), tuple(l_blocks[start // lb:]), hb, start // hb * hb,
                        start // lb * lb, start, n_seq - start)
    got = {}
    slow = CpuStandIn(asynchronous=True, delay_s=0.01)
    try:
        for name, ops in (("inline", CpuStandIn()), ("stream", slow)):
            phys = encode(dst_fmt, init.clone())
            ll = describe(dst_fmt, phys, lb)
            unit = -(-rl.bytes_per_block // 4096) * 4096
            staging = ReaderStaging(3 * unit, ll, ops=ops)  # small: several pieces
            planner = staging.planner_for(rl, _route(sh, dh, nheads))
            late = _run_stream(staging, rl, planner, read)
            assert (late > 0) == (name == "stream")
            assert staging.area.in_use == 0
            got[name] = phys.view(torch.uint8).clone()
    finally:
        slow.close()
    assert not torch.equal(got["inline"], encode(dst_fmt, init).view(torch.uint8))  # it moved something
    assert torch.equal(got["stream"], got["inline"])


def test_a_piece_keeps_its_range_until_its_scatter_event_completed():
    holder_kv, reader_kv = cpu_cache(8, 64, seed=3), cpu_cache(8, 32, seed=None)
    rl, ll = describe_kv_caches(holder_kv, block_size=64), describe_kv_caches(reader_kv, block_size=32)
    slow = CpuStandIn(asynchronous=True, delay_s=0.1)
    try:
        staging = ReaderStaging(1 << 20, ll, ops=slow)
        planner = staging.planner_for(rl, _route(0, 0, None))
        s = staging.stream(planner, NodeRead("h", (2, 5), (1, 4, 6, 0), 64, 0, 0, 10, 100), "p")
        job = staging.next_piece(s)
        play_plan(job.plan, rl, {staging.region_index: staging._mem})
        assert staging.scatter(s) is False  # enqueued, not done
        assert staging.area.in_use > 0 and s.job is job
        assert not tokens_kv(reader_kv, [1, 4, 6, 0], 32, 10, 110).any()  # not written yet
        with pytest.raises(AssertionError):
            staging.finish_scatter(s)  # the event has not completed
        assert s.scatter_event.wait(5.0)
        staging.finish_scatter(s)
        assert staging.area.in_use == 0 and s.finished
        assert torch.equal(tokens_kv(reader_kv, [1, 4, 6, 0], 32, 10, 110), tokens_kv(holder_kv, [2, 5], 64, 10, 110))
    finally:
        slow.close()


def test_cpu_staging_by_default_scatters_inline_with_no_stream_or_thread():
    threads = set(threading.enumerate())
    holder_kv, reader_kv = cpu_cache(4, 64, seed=4), cpu_cache(8, 32, seed=None)
    rl, ll = describe_kv_caches(holder_kv, block_size=64), describe_kv_caches(reader_kv, block_size=32)
    staging = ReaderStaging(1 << 20, ll, ops=CpuStandIn())
    assert staging._stream is None and staging.device == "cpu"
    assert staging.region().device == "cpu"
    s = staging.stream(staging.planner_for(rl, _route(0, 0, None)), NodeRead("h", (1,), (3, 2), 64, 0, 0, 0, 64), "p")
    job = staging.next_piece(s)
    play_plan(job.plan, rl, {staging.region_index: staging._mem})
    assert staging.scatter(s) is True and staging.area.in_use == 0
    assert torch.equal(tokens_kv(reader_kv, [3, 2], 32, 0, 64), tokens_kv(holder_kv, [1], 64, 0, 64))
    assert set(threading.enumerate()) <= threads


def test_region_tensors_must_be_the_layouts_regions():
    reader_kv = cpu_cache(4, 32, seed=None)
    ll = describe_kv_caches(reader_kv, block_size=32)
    tensors = region_tensors(reader_kv, ll)
    assert [t.data_ptr() for t in tensors] == [r.ptr for r in ll.regions]
    ReaderStaging(1 << 20, ll, tensors)
    with pytest.raises(ValueError, match="region tensor 0"):
        ReaderStaging(1 << 20, ll, [torch.zeros(ll.regions[0].nbytes, dtype=torch.uint8)])
    two = {"l0": cpu_cache(4, 32, None)["l0"], "l1": cpu_cache(4, 32, None)["l1"]}  # two allocations
    with pytest.raises(ValueError, match="1 region tensors for 2 KV regions"):
        ReaderStaging(1 << 20, describe_kv_caches(two, block_size=32), tensors)
    with pytest.raises(ValueError, match="none of the KV tensors' storage"):
        region_tensors(cpu_cache(4, 32, seed=None), ll)


def test_a_scatter_handle_reads_its_event_like_a_read():
    from pdxfer.device import DeviceError
    from pdxfer.transport.base import ReadState, TransferTimeout
    from pdxfer.vllm.worker.staging import ScatterHandle

    slow = CpuStandIn(asynchronous=True, delay_s=0.2)
    try:
        st = slow.new_stream()
        src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        slow.copy(dst, 0, src, 0, 64, st)
        h = ScatterHandle(slow.record_event(st), "cpu")
        assert h.poll() is ReadState.PENDING and h.error is None
        with pytest.raises(TransferTimeout, match="still running after 0.01 s"):
            h.wait(0.01)
        assert h.wait(5.0) is ReadState.DONE and dst.eq(1).all()

        def broken():
            raise RuntimeError("planted")

        import pdxfer.device.cpu as cpu_mod

        st2 = slow.new_stream()
        cpu_mod.CpuStream.submit(st2, broken)  # an op that fails on the stream
        bad = ScatterHandle(slow.record_event(st2), "cpu")
        with pytest.raises(DeviceError, match="scatter from staging on cpu failed: RuntimeError: planted"):
            bad.wait(5.0)
        assert bad.poll() is ReadState.FAILED
    finally:
        slow.close()
