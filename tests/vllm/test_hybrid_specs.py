"""What pdxfer reads from vLLM's own KV cache specs of a hybrid model (pdxfer.vllm.kv_cache_spec),
which holders a hybrid reader refuses (pdxfer.vllm.scheduler.reader_groups), and how the layout
describes tensors that vLLM shares between groups (pdxfer.kv.layout)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, SlidingWindowSpec)

from pdxfer.kv.groups import FULL, LAYOUT_KEY, SLIDING, GroupSpec, KVGroups
from pdxfer.kv.layout import describe_kv_caches
from pdxfer.master import NodeInfo
from pdxfer.vllm.holder_routes import NotReadable
from pdxfer.vllm.kv_cache_spec import UnmovableKVGroups, attention_spec, kv_groups, segment_layers
from pdxfer.vllm.scheduler.reader_groups import check_group_holder

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


@pytest.mark.parametrize("spec, why", [
    (MambaSpec(block_size=BS, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32)), "recurrent state"),
    (ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
])
def test_groups_pdxfer_does_not_move_are_refused_by_kind(spec, why):
    cfg = _config((["a"], FullAttentionSpec(**ATTN)), (["b"], spec))
    with pytest.raises(UnmovableKVGroups, match=why):
        kv_groups(cfg)


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
