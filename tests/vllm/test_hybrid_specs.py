"""What pdxfer reads from vLLM's own KV cache specs of a hybrid model (pdxfer.vllm.kv_cache_spec),
which holders a hybrid reader refuses (pdxfer.vllm.scheduler.reader_groups), how the layout
describes tensors that vLLM shares between groups (pdxfer.kv.layout), where recurrent state lies
in them (pdxfer.vllm.state_views), and the prefill step of a recurrent hybrid stopping one token
short in vLLM's own ``Request`` (pdxfer.vllm.state_handoff)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, SlidingWindowSpec)

from vllm import SamplingParams
from vllm.v1.request import Request

from pdxfer.contracts.prefill_step import is_prefill_step, prefill_step_params
from pdxfer.kv.groups import FULL, LAYOUT_KEY, SLIDING, STATE, GroupSpec, KVGroups
from pdxfer.kv.layout import LayoutError, describe_kv_caches
from pdxfer.master import NodeInfo
from pdxfer.vllm.holder_routes import NotReadable
from pdxfer.vllm.kv_cache_spec import UnmovableKVGroups, attention_spec, kv_groups, segment_layers, state_layers
from pdxfer.vllm.scheduler.reader_groups import check_group_holder, check_state_bytes
from pdxfer.vllm.state_handoff import truncate_prefill_step
from pdxfer.vllm.state_views import check_state_inside, split_state_views

BS = 16
ATTN = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def test_a_sliding_window_hybrid_is_moved_group_by_group():
    cfg = _config((["l.0", "l.3"], SlidingWindowSpec(**ATTN, sliding_window=64)),
                  (["l.1", "l.4"], SlidingWindowSpec(**ATTN, sliding_window=64)),
                  (["l.2", "l.5"], FullAttentionSpec(**ATTN)))
    groups = kv_groups(cfg)
    assert groups == KVGroups((GroupSpec(SLIDING, 64), GroupSpec(SLIDING, 64), GroupSpec(FULL)))
    spec, layers = attention_spec(cfg)
    assert spec.block_size == BS and sorted(layers) == [f"l.{i}" for i in range(6)]
    # Layer j of every group shares a tensor: the segment is named by the first in name order.
    assert segment_layers(cfg) == ["l.0", "l.3"]


def test_a_plain_model_is_one_full_group():
    assert kv_groups(_config((["a", "b"], FullAttentionSpec(**ATTN)))) == KVGroups.plain()
    assert not KVGroups.plain().hybrid and KVGroups((GroupSpec(SLIDING, 8),)).hybrid


PAGE = 2 * BS * 2 * 32 * 4  # one block of one ATTN layer, K and V


def _mamba(**kw) -> MambaSpec:
    return MambaSpec(**{"block_size": BS, "shapes": ((3, 8), (2, 8, 8)), "dtypes": (torch.bfloat16, torch.float32),
                        "page_size_padded": PAGE, "mamba_cache_mode": "align", **kw})


@pytest.mark.parametrize("spec, why", [
    (_mamba(mamba_cache_mode="none"), "mode 'none'"),
    (_mamba(num_speculative_blocks=2), "2 speculative scratch blocks"),
    (_mamba(num_prefill_checkpoint_blocks=1), "prefill checkpoint"),
    (ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
])
def test_groups_pdxfer_does_not_move_are_refused_by_kind(spec, why):
    cfg = _config((["a"], FullAttentionSpec(**ATTN)), (["b"], spec))
    with pytest.raises(UnmovableKVGroups, match=why):
        kv_groups(cfg)


def test_a_gated_delta_net_hybrid_moves_its_state_inside_the_attention_pages():
    cfg = _config((["l.0", "l.4"], _mamba()), (["l.1", "l.5"], _mamba()), (["l.2", "l.6"], _mamba()),
                  (["l.3", "l.7"], FullAttentionSpec(**ATTN)))
    assert kv_groups(cfg) == KVGroups((GroupSpec(STATE),) * 3 + (GroupSpec(FULL),))
    assert kv_groups(cfg).signature() == "state,state,state,full" and kv_groups(cfg).has_state
    spec, layers = attention_spec(cfg)
    assert isinstance(spec, FullAttentionSpec) and layers == ["l.3", "l.7"]
    # The attention layer of each slot names its tensor: a state view covers part of a page only.
    assert segment_layers(cfg) == ["l.3", "l.7"]
    assert state_layers(cfg) == {"l.0", "l.4", "l.1", "l.5", "l.2", "l.6"}


def test_recurrent_groups_of_another_page_size_or_alone_are_refused():
    with pytest.raises(UnmovableKVGroups, match="pages of 4096 bytes"):
        attention_spec(_config((["a"], FullAttentionSpec(**ATTN)), (["b"], _mamba(page_size_padded=4096))))
    with pytest.raises(UnmovableKVGroups, match="only beside attention"):
        kv_groups(_config((["a"], _mamba()), (["b"], _mamba())))


def _slot_views(n_blocks: int = 8):
    """One layer slot as vLLM 0.32 lays it out on CPU: an int8 allocation of pages, viewed whole
    by the attention layer ([blocks, heads, block_size, K and V]) and in part by a GDN layer."""
    raw = torch.zeros(n_blocks * PAGE, dtype=torch.int8)
    attention = raw.view(torch.float32).view(n_blocks, 2, BS, 64)
    state = torch.as_strided(raw, (n_blocks, 1, 1, 576), (PAGE, 576, 576, 1))
    return raw, attention, state


def test_state_views_must_lie_inside_the_registered_attention_pages():
    raw, attention, state = _slot_views()
    attn_views, state_views = split_state_views({"l.1": attention, "l.0": state}, {"l.0"})
    assert list(attn_views) == ["l.1"] and list(state_views) == ["l.0"]
    layout = describe_kv_caches(attn_views, block_size=BS, kv_format="cpu", dtype="float32")
    check_state_inside(layout, state_views)
    check_state_inside(layout, {"l.0": [state[:, :, :, :64], state[:, :, :, 64:]]})  # conv and SSM apart
    elsewhere = torch.zeros(8 * PAGE, dtype=torch.int8)
    for bad in (torch.as_strided(elsewhere, (8, 1, 1, 576), (PAGE, 576, 576, 1)),  # another allocation
                torch.as_strided(raw, (7, 1, 1, 576), (PAGE, 576, 576, 1), PAGE - 100),  # past a page's end
                torch.as_strided(raw, (4, 1, 1, 576), (2 * PAGE, 576, 576, 1))):  # another block stride
        with pytest.raises(LayoutError, match="recurrent layer l.0"):
            check_state_inside(layout, {"l.0": bad})


def test_a_recurrent_reader_refuses_holders_whose_pages_differ():
    raw, attention, _ = _slot_views()
    mine = describe_kv_caches({"a": attention}, block_size=BS, kv_format="cpu", dtype="float32")
    check_state_bytes("h1", [mine], {0: mine})
    other = describe_kv_caches({"a": torch.zeros(8, 2, BS, 64, dtype=torch.bfloat16)}, block_size=BS,
                               kv_format="cpu", dtype="bfloat16")
    with pytest.raises(NotReadable, match="recurrent state moves only between equal layouts"):
        check_state_bytes("h1", [other], {0: mine})
    with pytest.raises(NotReadable, match="rank 1"):
        check_state_bytes("h1", [mine], {0: mine, 1: mine})


def _request(prompt: list[int], params: dict | None) -> Request:
    # As vLLM's API server hands a request's kv_transfer_params to the engine.
    sampling = SamplingParams(max_tokens=7, extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request("r1", list(prompt), sampling, None)


def test_a_marked_prefill_step_stops_one_prompt_token_short_and_nothing_else_does():
    req = _request([5, 6, 7, 8], prefill_step_params())
    assert truncate_prefill_step(req) == 8
    assert req.prompt_token_ids == [5, 6, 7] and list(req.all_token_ids) == [5, 6, 7]
    assert req.num_prompt_tokens == 3 and req.num_tokens == 3 and req.max_tokens == 1
    # vLLM's own P/D proxies mark their prefill steps so; anything else is served whole.
    assert is_prefill_step({"do_remote_decode": True}) and truncate_prefill_step(
        _request([1, 2], {"do_remote_decode": True})) == 2
    for params in (None, {}, {"pdxfer_prefill": {"v": 99}}, {"pdxfer": {"v": 2}}, "x"):
        req = _request([5, 6, 7, 8], params if isinstance(params, (dict, type(None))) else None)
        assert truncate_prefill_step(req) is None and req.num_prompt_tokens == 4
        assert not is_prefill_step(params)
    assert truncate_prefill_step(_request([5], prefill_step_params())) is None  # nothing left to compute


def test_groups_of_different_block_shapes_are_refused():
    other = dict(ATTN, num_kv_heads=4)
    cfg = _config((["a"], FullAttentionSpec(**ATTN)), (["b"], SlidingWindowSpec(**other, sliding_window=32)))
    with pytest.raises(UnmovableKVGroups, match="one block shape"):
        attention_spec(cfg)


def _holder(groups: KVGroups, block_size: int = BS, tp_size: int = 1) -> NodeInfo:
    layout = {"block_size": block_size, LAYOUT_KEY: groups.to_wire()}
    return NodeInfo("h1", 0, "tcp", b"", layout, "fp", tp_size=tp_size)


def test_a_hybrid_reader_refuses_holders_it_cannot_read_naming_why():
    mine = KVGroups((GroupSpec(SLIDING, 64), GroupSpec(FULL)))
    check_group_holder(_holder(mine), mine, BS, 1)
    for holder, why in ((_holder(KVGroups((GroupSpec(SLIDING, 32), GroupSpec(FULL)))), r"groups \[sliding32,full\]"),
                        (_holder(mine, block_size=32), "blocks of 32 tokens"),
                        (_holder(mine, tp_size=2), "TP 2")):
        with pytest.raises(NotReadable, match=why):
            check_group_holder(holder, mine, BS, 1)


def test_a_tensor_shared_by_several_groups_is_one_segment():
    # vLLM's CPU blocks, [blocks, heads, block_size, K and V]: two layer slots in one allocation.
    raw = torch.zeros(2, 8, 2, BS, 64, dtype=torch.float32)
    views = {"l.0": raw[0], "l.1": raw[0], "l.2": raw[1], "l.3": raw[1]}
    layout = describe_kv_caches(views, block_size=BS, kv_format="cpu", dtype="float32")
    assert [s.layer for s in layout.segments] == ["l.0", "l.2"]
    assert layout.num_layers == 2
