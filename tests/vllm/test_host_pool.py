"""The worker's host pool: its layout is the KV cache's block format in host memory, an offload
job copies exactly the device blocks' bytes into the named slots (every segment), after the
step's writes, and a bad job or size is refused with its reason."""

from __future__ import annotations

import time

import pytest
import torch

from pdxfer.device import CpuStandIn, device_ops_for
from pdxfer.kv.layout import LayoutError, Region, describe_kv_caches
from pdxfer.contracts.connector_config import ConnectorConfigError, parse_extra_config
from pdxfer.vllm.worker.host_pool import HostPool, HostTierError, auto_host_tier_mib, host_layout, host_slots_for
from pdxfer.vllm.metadata import OffloadJob
from pdxfer.vllm.worker.staging import region_tensors

BLOCK = 16


def _kv(num_blocks: int = 12, layers: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    # FlashAttention's [2, blocks, block_size, heads, head_dim]: K and V apart in one region.
    return {f"model.layers.{i}.attn": torch.randn(2, num_blocks, BLOCK, 2, 8) for i in range(layers)}


def _pool(kv, slots: int, ops=None, extra: tuple[Region, ...] = ()) -> HostPool:
    layout = describe_kv_caches(kv, block_size=BLOCK)
    placeholders = [Region(r.index, r.nbytes, r.device) for r in layout.regions] + list(extra)
    return HostPool(layout, region_tensors(kv, layout), slots, placeholders, ops or device_ops_for("cpu"))


def _device_block_bytes(pool: HostPool, kv, block: int) -> bytes:
    t = region_tensors(kv, pool.device_layout)
    out = bytearray()
    for s in pool.device_layout.segments:
        off = s.block_offset(block)
        out += t[s.region][off: off + s.block_bytes].numpy().tobytes()
    return bytes(out)


def _poll_until(pool: HostPool, timeout: float = 5.0) -> tuple[list[int], dict[int, str]]:
    done, failed = [], {}
    deadline = time.monotonic() + timeout
    while pool.pending() and time.monotonic() < deadline:
        d, f = pool.poll()
        done += d
        failed.update(f)
        time.sleep(0.005)
    d, f = pool.poll()
    return done + d, {**failed, **f}


def test_host_layout_has_the_device_format_and_the_next_region_index():
    kv = _kv()
    layout = describe_kv_caches(kv, block_size=BLOCK)
    staging = Region(len(layout.regions), 4096, "cpu")
    placeholders = [Region(r.index, r.nbytes, r.device) for r in layout.regions] + [staging]
    host = host_layout(layout, 5, placeholders)
    assert host.fingerprint() == layout.fingerprint() and host.num_blocks == 5
    idx = len(placeholders)
    assert {s.region for s in host.segments} == {idx} and host.regions[idx].nbytes == 5 * layout.bytes_per_block
    # Same segments in the same order, each dense: slot s of segment i never overlaps another's.
    assert [(s.layer, s.part, s.head) for s in host.segments] == [(s.layer, s.part, s.head) for s in layout.segments]
    spans = sorted((s.block_offset(0), s.block_offset(4) + s.block_bytes) for s in host.segments)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(LayoutError, match="at least one slot"):
        host_layout(layout, 0, placeholders)


def test_slot_count_from_the_size_and_a_size_that_holds_no_block_is_refused():
    assert host_slots_for(0, 4096) == 0
    assert host_slots_for(1, 4096) == 256
    with pytest.raises(HostTierError, match="holds no KV block"):
        host_slots_for(1, 2 << 20)


def test_auto_size_is_a_quarter_of_the_available_memory_over_the_tp_ranks(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\n"
                       "MemAvailable:   16777216 kB\nBuffers:           10000 kB\n")
    # 16 GiB available: a quarter is 4 GiB, 2 GiB each for 2 ranks (available, not free, counts).
    assert auto_host_tier_mib(1, str(meminfo)) == 4096
    assert auto_host_tier_mib(2, str(meminfo)) == 2048
    assert 0 < auto_host_tier_mib(1) < 1 << 30  # this host's own /proc/meminfo
    meminfo.write_text("MemTotal:       33554432 kB\n")
    with pytest.raises(HostTierError, match=f"from {meminfo}.*no MemAvailable.*size in MiB"):
        auto_host_tier_mib(1, str(meminfo))
    with pytest.raises(HostTierError, match="missing"):
        auto_host_tier_mib(1, str(tmp_path / "missing"))
    assert parse_extra_config({"master": "m:1", "host_tier_mib": "auto"}).host_tier_mib is None
    assert parse_extra_config({"master": "m:1"}).host_tier_mib == 0  # off unless asked for
    with pytest.raises(ConnectorConfigError, match='host_tier_mib must be an int >= 0 or "auto"'):
        parse_extra_config({"master": "m:1", "host_tier_mib": "lots"})


@pytest.mark.parametrize("ops", [None, CpuStandIn(asynchronous=True, delay_s=0.01)], ids=["sync", "async"])
def test_an_offload_job_copies_exactly_its_blocks_into_its_slots(ops):
    kv = _kv()
    pool = _pool(kv, 6, ops)
    want = {slot: _device_block_bytes(pool, kv, b) for b, slot in ((7, 4), (8, 5), (2, 0), (9, 3), (10, 1))}
    pool.start(OffloadJob(11, (7, 8), (4, 5)))
    pool.start(OffloadJob(12, (2,), (0,)))
    pool.start(OffloadJob(11, (7, 8), (4, 5)))  # the same step's metadata bound twice: once
    pool.start(OffloadJob(13, (9, 10), (3, 1)))  # consecutive blocks into slots that are not
    done, failed = _poll_until(pool)
    assert sorted(done) == [11, 12, 13] and not failed
    for slot, b in want.items():
        assert pool.slot_bytes(slot) == b, slot
    # The untouched slots stay empty; another block's bytes differ (the check could fail).
    assert pool.slot_bytes(2) == bytes(len(want[0])) and want[4] != want[0]
    # The copy is a copy: the device blocks may be rewritten afterwards.
    for t in kv.values():
        t[:, 7].zero_()
    assert pool.slot_bytes(4) == want[4]
    assert pool.poll() == ([], {})  # each job is reported once


def test_a_bad_job_is_refused_naming_what_was_wrong():
    pool = _pool(_kv(), 4)
    with pytest.raises(LayoutError, match="host block id 4 outside"):
        pool.start(OffloadJob(1, (0,), (4,)))
    with pytest.raises(LayoutError, match="offload block id 99 outside"):
        pool.start(OffloadJob(2, (99,), (0,)))
    with pytest.raises(LayoutError, match="2 blocks for 1 host slots"):
        pool.start(OffloadJob(3, (0, 1), (0,)))


def test_a_copy_that_fails_on_the_device_is_reported_failed_not_done():
    kv = _kv()
    ops = CpuStandIn(asynchronous=True)
    pool = _pool(kv, 4, ops)
    pool._kv = [t[:8] for t in pool._kv]  # the device memory behind the job is not there
    pool.start(OffloadJob(5, (3,), (1,)))
    done, failed = _poll_until(pool)
    assert done == [] and list(failed) == [5], failed
