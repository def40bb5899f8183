"""vLLM's KV cache views under every KVCacheLayout, as pdxfer describes, converts and plans them.

The tensors are what vLLM's allocation gives (vLLM's own ``compute_layout_strides`` and
``create_kv_cache_views`` where vLLM imports, else the same placement rule written out here and
checked against vLLM's when it imports): per layer a ``[B, H, N, C]`` view, C being K then V of
one token and head (what FlashAttention's ``split(head_size, dim=-1)`` reads) or one MLA latent.
The oracle is torch indexing of those views; pdxfer's geometry is never used to build expectations.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdxfer.device import native
from pdxfer.kv.blockgeom import segment_geometry
from pdxfer.planning.convert import ConvertingPlanner, check_convertible, planner_for
from pdxfer.kv.heads import head_sources
from pdxfer.kv.layout import (ATTENTION, CPU, KV_HEAD_NC, KV_HNC, KV_NHC, MLA, MLA_NC, VLLM_LAYOUTS, KVDescription,
                           LayoutError, describe_kv_caches)
from pdxfer.planning.peer_plan import PeerPlanner
from tests.kv_pattern import decode, describe, encode, play_plan
from tests.kv_pattern import raw as raw_buf

try:
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                            compute_layout_strides, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout
except Exception:  # noqa: BLE001 - the unit tier runs without vLLM too
    KVCacheLayout = None

LAYOUTS = sorted(VLLM_LAYOUTS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _own_views(kind: str, layout: str, layers: int, nb: int, bs: int, heads: int, dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's placement rule: logical [L, B, H, N, C] strides packed in the permutation's order."""
    content = dim if kind == MLA else 2 * dim
    shape = (layers, nb, heads, bs, content)
    strides = [0] * 5
    step = 1
    for d in reversed(VLLM_LAYOUTS[layout]):
        strides[d] = step
        step *= shape[d]
    raw = torch.zeros(step, dtype=dtype)
    view = torch.as_strided(raw, shape, strides)
    return raw, {f"model.layers.{i}.attn": view[i] for i in range(layers)}


def vllm_views(kind: str, layout: str, layers: int, nb: int, bs: int, heads: int, dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(backing allocation, {layer: view}) as vLLM allocates one cache group of ``layers`` layers."""
    if KVCacheLayout is None:
        return _own_views(kind, layout, layers, nb, bs, heads, dim, dtype)
    if kind == MLA:
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=dim, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=dim, dtype=dtype)
    member = KVCacheLayout[layout]
    page = spec.page_size_bytes
    fixed = layers * page if member.is_block_outermost else None  # get_kv_cache_config's packing
    layer_stride, block_stride, *_ = compute_layout_strides(spec, nb, layers, member,
                                                            fixed_strides=(None, fixed, None, None, None))
    names = [f"model.layers.{i}.attn" for i in range(layers)]
    tensor = KVCacheTensor(size=layers * page * nb, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return raw, dict(zip(names, create_kv_cache_views(raw, spec, nb, member, tensor)))


def fill(views: dict[str, torch.Tensor], logical: torch.Tensor) -> None:
    """Logical ``[L, parts, nb, N, H, D]`` (parts: K, V or the latent) into the views."""
    d = logical.shape[-1]
    for i, name in enumerate(sorted(views, key=lambda n: int(n.split(".")[2]))):
        for p in range(logical.shape[1]):
            views[name][..., p * d:(p + 1) * d] = logical[i, p].permute(0, 2, 1, 3)


def read(views: dict[str, torch.Tensor], parts: int) -> torch.Tensor:
    names = sorted(views, key=lambda n: int(n.split(".")[2]))
    d = views[names[0]].shape[-1] // parts
    return torch.stack([torch.stack([views[n][..., p * d:(p + 1) * d].permute(0, 2, 1, 3) for p in range(parts)])
                        for n in names])


@st.composite
def cache_case(draw):
    kind = draw(st.sampled_from([ATTENTION, MLA]))
    return dict(kind=kind, layout=draw(st.sampled_from(LAYOUTS)), layers=draw(st.integers(1, 4)),
                nb=draw(st.integers(1, 5)), bs=draw(st.sampled_from([1, 2, 4, 16])),
                heads=1 if kind == MLA else draw(st.integers(1, 4)), dim=draw(st.sampled_from([1, 2, 8])),
                dtype=draw(st.sampled_from(sorted(DTYPES))), seed=draw(st.integers(0, 2**16)))


def _build(c: dict, layout: str | None = None, bs: int | None = None, heads: int | None = None, nb: int | None = None):
    layout, bs, heads, nb = layout or c["layout"], bs or c["bs"], heads or c["heads"], nb or c["nb"]
    raw, views = vllm_views(c["kind"], layout, c["layers"], nb, bs, heads, c["dim"], DTYPES[c["dtype"]])
    desc = KVDescription(c["kind"], layout, bs, heads, c["dim"], c["dtype"])
    return raw, views, desc


def test_pdxfer_knows_vllms_layout_permutations():
    if KVCacheLayout is None:
        pytest.skip("vLLM does not import here")
    assert VLLM_LAYOUTS == {m.name: m.value for m in KVCacheLayout}
    for layout in LAYOUTS:  # and the placement rule written out here is vLLM's
        for kind in (ATTENTION, MLA):
            heads = 1 if kind == MLA else 3
            _, own = _own_views(kind, layout, 3, 4, 2, heads, 8, torch.float16)
            _, theirs = vllm_views(kind, layout, 3, 4, 2, heads, 8, torch.float16)
            for name in own:
                o, t = own[name], theirs[name]
                assert o.shape == t.shape and o.stride() == t.stride(), (kind, layout)
                first_o, first_t = own[sorted(own)[0]], theirs[sorted(theirs)[0]]
                assert o.data_ptr() - first_o.data_ptr() == t.data_ptr() - first_t.data_ptr()


@SETTINGS
@given(c=cache_case())
def test_the_derived_layout_addresses_every_element_where_torch_indexing_puts_it(c):
    raw, views, desc = _build(c)
    parts = 1 if c["kind"] == MLA else 2
    g = torch.Generator().manual_seed(c["seed"])
    logical = torch.randn(c["layers"], parts, c["nb"], c["bs"], c["heads"], c["dim"], generator=g)
    logical = logical.to(DTYPES[c["dtype"]])
    fill(views, logical)
    layout = describe_kv_caches(views, description=desc)
    # The worker is told only the format; it must find the same layout from vLLM's tensors.
    assert describe_kv_caches(views, block_size=c["bs"], kv_format=desc.kv_format, dtype=c["dtype"]) == layout
    assert layout.kv_format == desc.kv_format and layout.num_blocks == c["nb"] and len(layout.regions) == 1
    esize = torch.empty(0, dtype=DTYPES[c["dtype"]]).element_size()
    flat = torch.empty(0, dtype=DTYPES[c["dtype"]]).set_(raw.untyped_storage())
    geom = segment_geometry(layout)
    names = sorted(views, key=lambda n: int(n.split(".")[2]))
    seen = 0
    b = torch.arange(c["nb"]).view(-1, 1, 1, 1)
    n = torch.arange(c["bs"]).view(1, -1, 1, 1)
    d = torch.arange(c["dim"]).view(1, 1, 1, -1)
    for s in layout.segments:
        heads = [s.head] if s.head >= 0 else list(range(c["heads"]))
        hg = torch.arange(len(heads)).view(1, 1, -1, 1)
        for p, part in enumerate(geom.parts):
            which = p if s.part == "kv" else 0
            off = s.base + b * s.block_stride + (part.base + n * part.tok_stride + hg * part.head_stride
                                                 + d * part.dim_stride) * esize
            assert bool((off % esize == 0).all())
            got = flat[off // esize]  # [nb, N, heads, D]
            want = logical[names.index(s.layer), which][:, :, heads]
            assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                               want.view(torch.uint8) if want.dtype != torch.float32 else want)
            seen += got.numel()
    assert seen == logical.numel()  # every element, each once


def test_heads_outside_blocks_are_one_segment_per_layer_and_head():
    c = dict(kind=ATTENTION, layers=2, nb=3, bs=4, heads=2, dim=8, dtype="float16")
    for layout in ("LHBNC", "BHLNC"):
        _, views, desc = _build(c, layout=layout)
        lay = describe_kv_caches(views, description=desc)
        assert lay.kv_format == KV_HEAD_NC and len(lay.segments) == 4
        assert {(s.layer, s.head) for s in lay.segments} == {(n, h) for n in views for h in range(2)}
        assert all(s.block_bytes == 4 * 16 * 2 for s in lay.segments)
    for layout, fmt in (("LBHNC", KV_HNC), ("BLHNC", KV_HNC), ("LBNHC", KV_NHC), ("BLNHC", KV_NHC)):
        _, views, desc = _build(c, layout=layout)
        lay = describe_kv_caches(views, description=desc)
        assert lay.kv_format == fmt and len(lay.segments) == 2
        stride = 2 * 2 * 4 * 16 * 2 if layout.startswith("B") else 2 * 4 * 16 * 2  # cross-layer block or a page
        assert {s.block_stride for s in lay.segments} == {stride}
    c["kind"], c["heads"] = MLA, 1
    for layout in LAYOUTS:
        _, views, desc = _build(c, layout=layout)
        assert describe_kv_caches(views, description=desc).kv_format == MLA_NC


def test_tensors_that_do_not_match_the_description_are_refused():
    c = dict(kind=ATTENTION, layers=2, nb=3, bs=4, heads=2, dim=8, dtype="float16")
    _, views, desc = _build(c, layout="LBNHC")
    with pytest.raises(LayoutError, match="not the LBHNC layout"):
        describe_kv_caches(views, description=KVDescription(ATTENTION, "LBHNC", 4, 2, 8, "float16"))
    with pytest.raises(LayoutError, match="block_size, content"):
        describe_kv_caches(views, description=KVDescription(ATTENTION, "LBNHC", 8, 2, 8, "float16"))
    with pytest.raises(LayoutError, match="cannot hold"):
        describe_kv_caches(views, description=KVDescription(ATTENTION, "LBNHC", 4, 2, 8, "bfloat16"))
    with pytest.raises(LayoutError, match="MLA cache holds one latent"):
        KVDescription(MLA, "LBNHC", 4, 2, 8, "float16")
    with pytest.raises(LayoutError, match="unknown vLLM KV cache layout 'NHD'"):
        KVDescription(ATTENTION, "NHD", 4, 2, 8, "float16")
    # BHLNC tensors named as the layer-compact kv_hnc format: a layer's block is not one range.
    _, views, _ = _build(c, layout="BHLNC")
    with pytest.raises(LayoutError, match="not one contiguous byte range|no vLLM layout"):
        describe_kv_caches(views, block_size=4, kv_format=KV_HNC)


# --------------------------------------------------------------------------- conversion

@st.composite
def convert_case(draw):
    c = draw(cache_case())
    attention = c["kind"] == ATTENTION
    src = draw(st.sampled_from(LAYOUTS + ([CPU] if attention else [])))
    dst = draw(st.sampled_from(LAYOUTS + ([CPU] if attention else [])))
    hr, hl = (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if attention else (1, 1)
    nheads = draw(st.integers(1, min(hr, hl)))
    hb, lb = draw(st.sampled_from([1, 4, 8])), draw(st.sampled_from([1, 4, 8]))
    n_seq = draw(st.integers(1, 40))
    start = draw(st.integers(0, n_seq - 1))
    c.update(src=src, dst=dst, hr=hr, hl=hl, nheads=nheads, src_head=draw(st.integers(0, hr - nheads)),
             dst_head=draw(st.integers(0, hl - nheads)), hb=hb, lb=lb, n_seq=n_seq, start=start,
             ntok=draw(st.integers(1, n_seq - start)), stage_at=8 * draw(st.integers(0, 16)))
    if c["dtype"] != "float32" or src == CPU or dst == CPU:
        c["dtype"] = "float32"  # the CPU format's reference encoder is float32 here
    return c


def _side(c: dict, which: str, logical: torch.Tensor, bs: int):
    """(keep-alive, layout, read back as logical) of one side in format or vLLM layout ``which``."""
    if which == CPU:
        phys = encode(CPU, logical)
        return phys, describe(CPU, phys, bs), lambda: decode(CPU, phys)
    parts = logical.shape[1]
    _, views, desc = _build(dict(c, dtype=str(logical.dtype).removeprefix("torch.")), layout=which, bs=bs,
                            heads=logical.shape[4], nb=logical.shape[2])
    fill(views, logical)
    return views, describe_kv_caches(views, description=desc), lambda: read(views, parts)


@SETTINGS
@given(c=convert_case())
def test_conversion_between_every_pair_and_the_cpu_format_is_exact(c):
    g = torch.Generator().manual_seed(c["seed"])
    dtype, parts = DTYPES[c["dtype"]], 1 if c["kind"] == MLA else 2
    hb, lb, end = c["hb"], c["lb"], c["start"] + c["ntok"]
    h_nb, l_nb = -(-c["n_seq"] // hb) + 2, -(-c["n_seq"] // lb) + 2
    h_blocks = [int(b) for b in torch.randperm(h_nb, generator=g)[: -(-c["n_seq"] // hb)]]
    l_blocks = [int(b) for b in torch.randperm(l_nb, generator=g)[: -(-c["n_seq"] // lb)]]
    hold = torch.randn(c["layers"], parts, h_nb, hb, c["hr"], c["dim"], generator=g).to(dtype)
    mine = torch.randn(c["layers"], parts, l_nb, lb, c["hl"], c["dim"], generator=g).to(dtype)
    h_keep, rl, _ = _side(c, c["src"], hold, hb)
    l_keep, ll, read_back = _side(c, c["dst"], mine, lb)
    check_convertible(rl, ll)
    planner = ConvertingPlanner(rl, ll, staging_region=len(ll.regions), src_head=c["src_head"],
                                dst_head=c["dst_head"], nheads=c["nheads"])
    first_h, first_l = c["start"] // hb, c["start"] // lb
    job = planner.read(h_blocks[first_h: -(-end // hb)], first_h * hb, l_blocks[first_l:], first_l * lb,
                       c["start"], c["ntok"], staging_offset=c["stage_at"])
    staging = np.zeros(c["stage_at"] + job.staging_bytes, dtype=np.uint8)
    play_plan(job.plan, rl, {len(ll.regions): staging})
    local_mem = next(iter(l_keep.values())) if isinstance(l_keep, dict) else l_keep
    planner.scatter(job, native.RawBuffer(staging.ctypes.data, staging.nbytes), [raw_buf(local_mem)])
    del h_keep

    want = mine.clone()
    t = torch.arange(c["start"], end)
    li, hi = torch.as_tensor(l_blocks)[t // lb], torch.as_tensor(h_blocks)[t // hb]
    sh, dh, n = c["src_head"], c["dst_head"], c["nheads"]
    want[:, :, li, t % lb, dh:dh + n] = hold[:, :, hi, t % hb, sh:sh + n]
    assert torch.equal(read_back().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_mla_and_attention_caches_are_not_converted_into_each_other():
    a = _build(dict(kind=MLA, layers=2, nb=3, bs=4, heads=1, dim=8, dtype="float16"), layout="LBHNC")
    b = _build(dict(kind=ATTENTION, layers=2, nb=3, bs=4, heads=1, dim=4, dtype="float16"), layout="LBHNC")
    la, lb_ = describe_kv_caches(a[1], description=a[2]), describe_kv_caches(b[1], description=b[2])
    assert la.block_size == lb_.block_size and sum(s.block_bytes for s in la.segments) == \
        sum(s.block_bytes for s in lb_.segments)  # same bytes per block, other numbers
    assert la.fingerprint() != lb_.fingerprint() and la.content_fingerprint(1) != lb_.content_fingerprint(1)
    with pytest.raises(LayoutError, match="holder stores mla KV and this reader attention KV"):
        check_convertible(la, lb_)


# --------------------------------------------------------------------------- plans

def _block_runs(remote: list[int], local: list[int]) -> int:
    return 1 + sum(1 for i in range(1, len(remote)) if (remote[i] - remote[i - 1], local[i] - local[i - 1]) != (1, 1))


@SETTINGS
@given(c=cache_case(), data=st.data())
def test_block_outermost_reads_are_one_run_per_block_run_and_move_exact_bytes(c, data):
    nb = 12
    n = data.draw(st.integers(1, nb))
    remote = data.draw(st.permutations(range(nb)))[:n]
    local = sorted(data.draw(st.permutations(range(nb)))[:n]) if data.draw(st.booleans()) else \
        data.draw(st.permutations(range(nb)))[:n]
    if data.draw(st.booleans()):  # consecutive runs, as vLLM's allocator mostly hands out
        remote = list(range(nb - n, nb))
    parts = 1 if c["kind"] == MLA else 2
    g = torch.Generator().manual_seed(c["seed"])
    hold = torch.randn(c["layers"], parts, nb, c["bs"], c["heads"], c["dim"], generator=g).to(DTYPES[c["dtype"]])
    h_keep, rl, _ = _side(c, c["layout"], hold, c["bs"])
    l_keep, ll, read_back = _side(c, c["layout"], torch.zeros_like(hold), c["bs"])
    plan = PeerPlanner(rl, ll).plan(remote, local)
    runs = _block_runs(remote, local)
    if c["layout"].startswith("B"):
        assert len(plan.runs) == runs
    else:  # layer-outermost: one run per (segment, block run), fewer where a layer's last block meets the next's
        assert runs <= len(plan.runs) <= len(rl.segments) * runs
    local_mem = next(iter(l_keep.values()))
    play_plan(plan, rl, {0: _np_bytes(local_mem)})
    del h_keep
    want = torch.zeros_like(hold)
    want[:, :, local] = hold[:, :, remote]
    assert torch.equal(read_back().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def _np_bytes(t: torch.Tensor) -> np.ndarray:
    s = t.untyped_storage()
    return np.frombuffer((ctypes.c_uint8 * s.nbytes()).from_address(s.data_ptr()), dtype=np.uint8)


def test_an_mla_holder_of_any_tp_size_serves_every_reader_rank_whole():
    # The connector counts an MLA latent as one KV head of the model, which every rank holds.
    for holder_tp in (1, 2, 4, 8):
        for reader_tp in (1, 2, 4, 8):
            for rank in range(reader_tp):
                (src,) = head_sources(1, holder_tp, reader_tp, rank)
                assert (src.src_head, src.dst_head, src.nheads) == (0, 0, 1)
                assert 0 <= src.holder_rank < holder_tp
            # readers spread over the holder's ranks
            assert len({head_sources(1, holder_tp, reader_tp, r)[0].holder_rank for r in range(reader_tp)}) == \
                min(holder_tp, reader_tp)


def test_per_head_segments_cross_the_wire_and_old_descriptions_still_read():
    _, views, desc = _build(dict(kind=ATTENTION, layers=2, nb=3, bs=4, heads=2, dim=8, dtype="float16"),
                            layout="BHLNC")
    lay = describe_kv_caches(views, description=desc)
    back = type(lay).from_wire(lay.to_wire())
    assert [s.head for s in back.segments] == [s.head for s in lay.segments] == [0, 1, 0, 1]
    assert back.fingerprint() == lay.fingerprint()
    doc = lay.to_wire()
    for s in doc["segments"]:  # a description from before segments named a head
        del s["head"]
    assert {s.head for s in type(lay).from_wire(doc).segments} == {-1}


def test_cross_layer_blocks_with_a_gap_are_planned_per_segment_and_still_exact():
    # Another group's page sits in each cross-layer block: the layers' pages do not tile it, so a
    # block run cannot be one range; the plan falls back to one run per (segment, block).
    layers, nb, bs, heads, dim = 3, 6, 4, 2, 8
    page = heads * bs * 2 * dim * 2
    stride = (layers + 1) * page
    raw = torch.randn(stride * nb // 2, dtype=torch.float32).to(torch.float16)
    views = {f"model.layers.{i}.attn": torch.as_strided(raw, (nb, heads, bs, 2 * dim),
                                                        (stride // 2, bs * 2 * dim, 2 * dim, 1), i * page // 2)
             for i in range(layers)}
    desc = KVDescription(ATTENTION, "BLHNC", bs, heads, dim, "float16")
    rl = describe_kv_caches(views, description=desc)
    target = torch.zeros_like(raw)
    lviews = {n: torch.as_strided(target, v.shape, v.stride(), v.storage_offset()) for n, v in views.items()}
    ll = describe_kv_caches(lviews, description=desc)
    plan = PeerPlanner(rl, ll).plan([1, 2, 3], [0, 1, 2])
    assert len(plan.runs) == layers * 3
    play_plan(plan, rl, {0: _np_bytes(target)})
    for n in views:
        assert torch.equal(lviews[n][0:3], views[n][1:4]) and not lviews[n][3:].any()


@pytest.mark.parametrize("holder, reader", [("LHBNC", "LHBNC"), ("BHLNC", "LHBNC"), ("BHLNC", "BHLNC")])
def test_a_head_slice_of_per_head_segments_is_read_straight_into_place(holder, reader):
    # TP: a reader rank with 2 of the holder rank's 4 heads (heads 1 and 2 into its 0 and 1).
    c = dict(kind=ATTENTION, layers=3, nb=5, bs=4, dim=8, dtype="float16", seed=0)
    hold = torch.randn(3, 2, 5, 4, 4, 8, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    h_keep, rl, _ = _side(c, holder, hold, 4)
    l_keep, ll, read_back = _side(c, reader, torch.zeros(3, 2, 5, 4, 2, 8, dtype=torch.float16), 4)
    planner = planner_for(rl, ll, None, src_head=1, dst_head=0, nheads=2)
    assert isinstance(planner, PeerPlanner)  # no staging area was even offered
    plan = planner.plan([4, 0, 1], [1, 2, 3])
    assert plan.total_bytes == 3 * 3 * 2 * (4 * 16 * 2)  # blocks x layers x heads x one head's block
    play_plan(plan, rl, {0: _np_bytes(next(iter(l_keep.values())))})
    del h_keep
    want = torch.zeros(3, 2, 5, 4, 2, 8, dtype=torch.float16)
    want[:, :, [1, 2, 3]] = hold[:, :, [4, 0, 1], :, 1:3]
    assert torch.equal(read_back().contiguous().view(torch.uint8), want.view(torch.uint8))
