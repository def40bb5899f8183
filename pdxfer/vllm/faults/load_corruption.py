"""Test hook: corrupt a load on purpose after its bytes landed, before it is reported loaded.

It exists to prove that the real-vLLM pair tests' oracle catches wrong KV (a mutation check):
with hook file ``corrupt_load`` (see :mod:`pdxfer.vllm.faults.hooks`, off unless
``$PDXFER_TEST_HOOKS_DIR`` is set) naming a mode, every load that succeeds is damaged in the
reader's own blocks, and is still counted and reported as loaded:

- ``shift``: the loaded blocks move one block later (block i gets block i-1's bytes; the first
  keeps its own), as if the load had been placed one block off;
- ``other``: the middle loaded block gets the bytes of a block an earlier load filled, i.e.
  another request's KV;
- ``zero_layer``: the first layer (K and V) of every loaded block is zeroed;
- ``zero_window`` (hybrid models): the first layer of the first sliding-window group's loaded
  blocks is zeroed: one sliding layer's window, every other group intact;
- ``zero_state`` (recurrent hybrids): the first recurrent group's loaded state block is zeroed
  in the first layer slot: one Mamba / gated delta-net layer's state;
- ``other_state`` (recurrent hybrids): that block gets the bytes of the state block an earlier
  load filled, i.e. another request's state.

Only host memory (CPU KV caches) is touched; the bytes are addressed through the registered
layout, so any block format works.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Sequence

from pdxfer.kv.groups import SLIDING, STATE
from pdxfer.kv.layout import KVLayout
from pdxfer.vllm.faults.hooks import test_hook_text

log = logging.getLogger("pdxfer.vllm.worker")

HOOK_NAME = "corrupt_load"
MODES = ("shift", "other", "zero_layer", "zero_window", "zero_state", "other_state")

# Blocks that earlier loads filled: where modes "other" and "other_state" take another request's
# bytes from.
_earlier: list[int] = []
_earlier_state: list[int] = []


def _block_ranges(layout: KVLayout, block: int, layer: str | None = None) -> list[tuple[int, int]]:
    """(address, length) of every byte range of ``block`` (of one layer, or all)."""
    out = []
    for seg in layout.segments:
        if layer is None or seg.layer == layer:
            out.append((layout.regions[seg.region].ptr + seg.block_offset(block), seg.block_bytes))
    return out


def _copy_block(layout: KVLayout, dst: int, src: int) -> None:
    for (d, n), (s, _) in zip(_block_ranges(layout, dst), _block_ranges(layout, src)):
        ctypes.memmove(d, s, n)


def maybe_corrupt_load(layout: KVLayout | None, req_id: str, blocks: Sequence[int],
                       groups: Sequence[tuple[str, Sequence[int]]] = ()) -> None:
    """Damage the landed load of ``req_id`` into ``blocks`` (token order) when the hook asks to;
    ``groups``: a hybrid load's (group kind, blocks) per KV cache group.

    Called by the worker once a load's bytes are in its blocks and before it is validated and
    reported; without the hook this costs one environment lookup.
    """
    mode = test_hook_text(HOOK_NAME)
    blocks = list(blocks)
    if mode is None or layout is None or not blocks:
        return
    if any(r.device != "cpu" or not r.ptr for r in layout.regions):
        log.error("pdxfer test hook %s: only host KV caches can be corrupted; load of %s left intact",
                  HOOK_NAME, req_id)
        return
    others = [b for b in _earlier if b not in set(blocks)]
    state = next((list(got) for kind, got in groups if kind == STATE and got), [])
    other_states = [b for b in _earlier_state if b not in set(state)]
    if mode == "shift" and len(blocks) > 1:
        for i in range(len(blocks) - 1, 0, -1):
            _copy_block(layout, blocks[i], blocks[i - 1])
    elif mode == "other" and others:
        _copy_block(layout, blocks[len(blocks) // 2], others[-1])
    elif mode == "zero_layer":
        first = layout.segments[0].layer
        for b in blocks:
            for addr, n in _block_ranges(layout, b, first):
                ctypes.memset(addr, 0, n)
    elif mode == "zero_window" and any(kind == SLIDING and got for kind, got in groups):
        window = next(list(got) for kind, got in groups if kind == SLIDING and got)
        first = layout.segments[0].layer
        for b in window:
            for addr, n in _block_ranges(layout, b, first):
                ctypes.memset(addr, 0, n)
    elif mode == "zero_state" and state:
        addr, n = _block_ranges(layout, state[0], layout.segments[0].layer)[0]
        ctypes.memset(addr, 0, n)
    elif mode == "other_state" and state and other_states:
        (d, n), (s, _) = (_block_ranges(layout, b, layout.segments[0].layer)[0] for b in (state[0], other_states[-1]))
        ctypes.memmove(d, s, n)
    else:
        log.error("pdxfer test hook %s: cannot apply mode %r to the load of %s (%d blocks, %d earlier); "
                  "modes: %s", HOOK_NAME, mode, req_id, len(blocks), len(others), ", ".join(MODES))
        _remember(blocks, state)
        return
    log.warning("pdxfer test hook %s: corrupted the load of %s (mode %s, %d blocks)", HOOK_NAME, req_id,
                mode, len(blocks))
    _remember(blocks, state)


def _remember(blocks: list[int], state: list[int]) -> None:
    _earlier.extend(blocks)
    del _earlier[:-256]  # bounded: only a recent block is ever needed
    _earlier_state.extend(state[:1])
    del _earlier_state[:-16]
