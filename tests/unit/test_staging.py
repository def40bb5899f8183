"""The reader's staging area: first-fit reservations shared by concurrent converting loads."""

from __future__ import annotations

import pytest

from pdxfer.convert import StagingArea
from pdxfer.layout import describe_kv_caches
from pdxfer.vllm.metadata import NodeRead
from pdxfer.vllm.worker_staging import ReaderStaging
from tests.unit.test_convert import cpu_cache


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
    staging = ReaderStaging(1, describe_kv_caches(cpu_cache(8, 64, None), block_size=64))
    route = type("Route", (), {"src_head": 0, "dst_head": 0, "nheads": None})()
    planner = staging.planner_for(holder, route)
    first = staging.start(planner, NodeRead("h", (1, 2), (0, 1, 2, 3), 128, 0, 0, 0, 200))
    held = staging.area.in_use
    assert held >= first.staging_bytes > 0
    with pytest.raises(ValueError):
        staging.start(planner, NodeRead("h", (), (), 128, 0, 0, 0, 0))
    assert staging.area.in_use == held  # the first load's range is still reserved
    with pytest.raises(ValueError):
        staging.start_pairs(planner, NodeRead("h", (), ()))
    assert staging.area.in_use == held  # the first load's range is still reserved
    assert staging.area.alloc(4096) == -(-first.staging_bytes // 4096) * 4096
