"""The reader's staging area: first-fit reservations shared by concurrent converting loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer.convert import StagingArea
from pdxfer.layout import describe_kv_caches
from pdxfer.vllm.config import ConnectorConfigError, parse_extra_config
from pdxfer.vllm.metadata import NodeRead
from pdxfer.vllm.worker_staging import ReaderStaging, auto_staging_bytes
from tests.kv_pattern import play_plan
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
