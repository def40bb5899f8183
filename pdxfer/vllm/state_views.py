"""Where a hybrid model's recurrent state lies: inside the attention pages that move anyway.

vLLM's hybrid KV cache manager gives layer ``j`` of every KV cache group one tensor, viewed per
layer: an attention layer's view covers each block's whole page, a Mamba / gated delta-net
layer's view (its conv and SSM state) only part of it. pdxfer registers and moves the attention
views' pages; the state then moves with the block that holds it. This module checks that
premise on the real tensors, so a vLLM that laid state out elsewhere is refused at start
rather than moving half a state.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pdxfer.kv.layout import KVLayout, LayoutError


def split_state_views(kv_caches: Mapping[str, Any], state_layers: Iterable[str],
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(attention views, recurrent views) of the dict vLLM hands to ``register_kv_caches``."""
    state = set(state_layers)
    return ({n: t for n, t in kv_caches.items() if n not in state},
            {n: t for n, t in kv_caches.items() if n in state})


def check_state_inside(layout: KVLayout, state_views: Mapping[str, Any]) -> None:
    """LayoutError (naming the layer) unless every block of every recurrent view lies inside the
    same block's page of a registered segment covering its whole page."""
    for name, views in state_views.items():
        for t in views if isinstance(views, (list, tuple)) else (views,):
            _check_one(layout, name, t)


def _check_one(layout: KVLayout, name: str, t: Any) -> None:
    esize = t.element_size()
    stride = int(t.stride(0)) * esize
    span = (sum((int(n) - 1) * int(s) for n, s in zip(t.shape[1:], t.stride()[1:])) + 1) * esize
    sptr = t.untyped_storage().data_ptr()
    for seg in layout.segments:
        region = layout.regions[seg.region]
        if region.ptr != sptr or seg.block_stride != stride or seg.block_bytes != seg.block_stride:
            continue
        at = t.data_ptr() - sptr - seg.base
        if 0 <= at and at + span <= seg.block_bytes and int(t.shape[0]) <= layout.num_blocks:
            return
    raise LayoutError(f"recurrent layer {name}: its state view (shape {tuple(t.shape)}, block stride {stride} "
                      "bytes) does not lie inside the pages of a registered attention tensor; pdxfer cannot move "
                      "its state with the attention blocks")
