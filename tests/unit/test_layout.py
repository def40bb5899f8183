import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.kv.layout import (BLOCKS_FIRST_NHD, CPU, FLASH_HND, FLASH_NHD, KVLayout, LayoutError, describe_kv_caches,
                           detect_format)
from pdxfer.kv.chunks import blocks_for_chunks, blocks_for_tokens, chunk_span
from pdxfer.planning.peer_plan import build_plan


def make_caches(fmt, layers, blocks, block_size, heads=2, head_dim=8, dtype=torch.float16,
                one_allocation=False, blocks_outer=False, seed=0):
    """KV caches shaped like vLLM's, filled with distinct values per element."""
    per_layer = {
        CPU: (blocks, heads, block_size, 2 * head_dim),
        FLASH_NHD: (2, blocks, block_size, heads, head_dim),
        FLASH_HND: (2, blocks, heads, block_size, head_dim),
        BLOCKS_FIRST_NHD: (blocks, 2, block_size, heads, head_dim),
    }[fmt]
    g = torch.Generator().manual_seed(seed)
    if one_allocation and fmt == CPU:
        if blocks_outer:
            raw = torch.randn((blocks, layers) + per_layer[1:], generator=g).to(dtype)
            return {f"model.layers.{i}.attn": raw[:, i] for i in range(layers)}
        raw = torch.randn((layers,) + per_layer, generator=g).to(dtype)
        return {f"model.layers.{i}.attn": raw[i] for i in range(layers)}
    return {f"model.layers.{i}.attn": torch.randn(per_layer, generator=g).to(dtype) for i in range(layers)}


def region_tensors(caches):
    """Flat uint8 views of each distinct storage, in region order of describe_kv_caches."""
    seen, out = set(), []
    for name in sorted(caches):
        st_ = caches[name].untyped_storage()
        if st_.data_ptr() not in seen:
            seen.add(st_.data_ptr())
            out.append(torch.empty(0, dtype=torch.uint8).set_(st_))
    return out


def apply_plan(plan, remote_regions, local_regions):
    """Execute a plan with plain memory copies (what a transport does over the wire)."""
    for r in plan.runs:
        src = remote_regions[r.remote_region][r.remote_offset:r.remote_offset + r.nbytes]
        local_regions[r.local_region][r.local_offset:r.local_offset + r.nbytes].copy_(src)


def block_dim(fmt):
    return 1 if fmt in (FLASH_NHD, FLASH_HND) else 0


def test_cpu_views_of_one_allocation_are_one_region():
    caches = make_caches(CPU, layers=4, blocks=10, block_size=16, one_allocation=True)
    lay = describe_kv_caches(caches)
    assert lay.kv_format == CPU and len(lay.regions) == 1
    assert lay.num_layers == 4 and lay.num_blocks == 10 and lay.block_size == 16
    assert lay.kv_heads == 2 and lay.head_dim == 8
    seg_bytes = 2 * 16 * 16 * 2
    assert [s.block_bytes for s in lay.segments] == [seg_bytes] * 4
    assert [s.base for s in lay.segments] == [i * 10 * seg_bytes for i in range(4)]
    assert lay.bytes_per_block == 4 * seg_bytes


def test_blocks_outer_allocation_has_large_stride():
    caches = make_caches(CPU, layers=3, blocks=5, block_size=16, one_allocation=True, blocks_outer=True)
    lay = describe_kv_caches(caches)
    seg = lay.segments[1]
    assert len(lay.regions) == 1 and seg.block_stride == 3 * seg.block_bytes and seg.base == seg.block_bytes


def test_flash_layers_get_k_and_v_segments_and_own_regions():
    caches = make_caches(FLASH_NHD, layers=2, blocks=6, block_size=16)
    lay = describe_kv_caches(caches, block_size=16)
    assert len(lay.regions) == 2 and [s.part for s in lay.segments] == ["k", "v", "k", "v"]
    k, v = lay.segments[0], lay.segments[1]
    assert v.base - k.base == 6 * k.block_stride


def test_nhd_hnd_ambiguity_needs_block_size():
    shape = (2, 10, 8, 8, 64)
    with pytest.raises(LayoutError, match="ambiguous"):
        detect_format(shape)
    assert detect_format((2, 10, 16, 8, 64), 16) == FLASH_NHD
    assert detect_format((2, 10, 8, 16, 64), 16) == FLASH_HND


@pytest.mark.parametrize("shape", [(10, 20), (3, 10, 2, 16, 8), (2, 3, 4, 5, 6, 7)])
def test_unknown_shapes_are_named(shape):
    with pytest.raises(LayoutError, match=r"matches no known format"):
        describe_kv_caches({"l0": torch.zeros(shape)})


def test_mixed_shapes_and_non_tensors_rejected():
    with pytest.raises(LayoutError, match="differs"):
        describe_kv_caches({"a": torch.zeros(4, 2, 16, 16), "b": torch.zeros(5, 2, 16, 16)})
    with pytest.raises(LayoutError, match="torch tensor"):
        describe_kv_caches({"a": np.zeros((4, 2, 16, 16))})
    with pytest.raises(LayoutError, match="no KV cache"):
        describe_kv_caches({})


def test_non_contiguous_block_rejected():
    t = torch.zeros(4, 16, 2, 16).transpose(1, 2)  # [blocks, heads, bs, 2d] with swapped strides
    with pytest.raises(LayoutError, match="contiguous"):
        describe_kv_caches({"a": t}, kv_format=CPU)


def test_wire_round_trip_and_fingerprint():
    lay = describe_kv_caches(make_caches(CPU, 2, 8, 16, one_allocation=True))
    back = KVLayout.from_wire(lay.to_wire())
    assert back.fingerprint() == lay.fingerprint() and back.segments == lay.segments
    assert all(r.ptr == 0 for r in back.regions)  # addresses never cross a process
    other = describe_kv_caches(make_caches(CPU, 2, 8, 16, dtype=torch.bfloat16))
    more_blocks = describe_kv_caches(make_caches(CPU, 2, 30, 32))
    assert other.fingerprint() != lay.fingerprint()
    assert more_blocks.fingerprint() == lay.fingerprint()  # block count/size are not identity
    bad = lay.to_wire() | {"v": 99}
    with pytest.raises(LayoutError, match="version"):
        KVLayout.from_wire(bad)
    with pytest.raises(LayoutError, match="malformed"):
        KVLayout.from_wire({"v": 1})


def test_blocks_for_tokens():
    assert list(blocks_for_tokens(0, 256, 128)) == [0, 1]
    assert list(blocks_for_tokens(100, 300, 128)) == [0, 1, 2]
    assert list(blocks_for_tokens(5, 5, 16)) == []
    with pytest.raises(LayoutError):
        blocks_for_tokens(10, 5, 16)
    with pytest.raises(LayoutError):
        blocks_for_tokens(-1, 5, 16)


def test_chunk_span_divides_multiple_and_neither():
    s = chunk_span(3, 256, 128)
    assert (s.first_block, s.num_blocks, s.chunks_per_block) == (6, 2, 1)
    s = chunk_span(5, 256, 1024)
    assert (s.first_block, s.num_blocks, s.chunks_per_block) == (1, 1, 4)
    assert chunk_span(2, 256, 256).first_block == 2
    with pytest.raises(LayoutError, match="neither divides nor is a multiple"):
        chunk_span(0, 256, 96)
    assert blocks_for_chunks(3, 256, 128) == 6
    assert blocks_for_chunks(7, 256, 1024) == 1  # only whole blocks can move


def test_plan_coalesces_consecutive_blocks():
    caches = make_caches(CPU, 4, 64, 16, one_allocation=True)
    lay = describe_kv_caches(caches)
    plan = build_plan(lay, list(range(10, 20)), lay, list(range(30, 40)))
    assert plan.uncoalesced_runs == 40 and len(plan) == 4
    partial = build_plan(lay, [1, 2, 3, 9], lay, [5, 6, 7, 8])
    assert len(partial) == 4 * 2
    nc = build_plan(lay, list(range(10, 20)), lay, list(range(30, 40)), coalesce_runs=False)
    assert len(nc) == 40 and nc.total_bytes == plan.total_bytes == 10 * lay.bytes_per_block


def test_plan_rejects_bad_requests():
    lay = describe_kv_caches(make_caches(CPU, 2, 8, 16))
    with pytest.raises(LayoutError, match="remote block id 8"):
        build_plan(lay, [8], lay, [0])
    with pytest.raises(LayoutError, match="local block id -1"):
        build_plan(lay, [0], lay, [-1])
    with pytest.raises(LayoutError, match="2 remote blocks but 1 local"):
        build_plan(lay, [0, 1], lay, [0])
    with pytest.raises(LayoutError, match="repeat"):
        build_plan(lay, [0, 1], lay, [3, 3])
    other = describe_kv_caches(make_caches(CPU, 2, 8, 16, dtype=torch.float32))
    with pytest.raises(LayoutError, match="layouts differ"):
        build_plan(lay, [0], other, [0])
    bigger = describe_kv_caches(make_caches(CPU, 2, 8, 32))
    with pytest.raises(LayoutError, match="block size differs"):
        build_plan(lay, [0], bigger, [0])


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from([CPU, FLASH_NHD, FLASH_HND, BLOCKS_FIRST_NHD]),
    layers=st.integers(1, 4),
    block_size=st.sampled_from([16, 32]),
    remote_blocks=st.integers(4, 24),
    local_blocks=st.integers(4, 24),
    one_allocation=st.booleans(),
    blocks_outer=st.booleans(),
    data=st.data(),
)
def test_plan_applied_with_memcpy_equals_torch_indexing(fmt, layers, block_size, remote_blocks,
                                                       local_blocks, one_allocation, blocks_outer, data):
    remote = make_caches(fmt, layers, remote_blocks, block_size, one_allocation=one_allocation,
                         blocks_outer=blocks_outer, seed=1)
    local = make_caches(fmt, layers, local_blocks, block_size, one_allocation=one_allocation, seed=2)
    n = data.draw(st.integers(0, min(remote_blocks, local_blocks)))
    src = data.draw(st.lists(st.integers(0, remote_blocks - 1), min_size=n, max_size=n))
    dst = data.draw(st.permutations(range(local_blocks)))[:n]
    if data.draw(st.booleans()) and n:  # bias towards runs that coalesce
        start_s = data.draw(st.integers(0, remote_blocks - n))
        start_d = data.draw(st.integers(0, local_blocks - n))
        src, dst = list(range(start_s, start_s + n)), list(range(start_d, start_d + n))
    kw = {"block_size": block_size} if fmt != CPU else {}
    rl, ll = describe_kv_caches(remote, **kw), describe_kv_caches(local, **kw)
    plan = build_plan(rl, src, ll, dst)

    bd = block_dim(fmt)
    expected = {}
    for name, t in local.items():
        e = t.clone()
        if n:
            idx_d, idx_s = torch.tensor(dst), torch.tensor(src)
            if bd == 0:
                e[idx_d] = remote[name][idx_s]
            else:
                e[:, idx_d] = remote[name][:, idx_s]
        expected[name] = e

    apply_plan(plan, region_tensors(remote), region_tensors(local))
    for name in local:
        assert torch.equal(local[name], expected[name]), name
    assert plan.total_bytes == n * rl.bytes_per_block
    assert len(plan) <= plan.uncoalesced_runs == n * len(rl.segments)
