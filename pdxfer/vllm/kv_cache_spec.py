"""What vLLM's KV cache config says about the KV bytes, read the same way by the scheduler's
layout (connector_layout.py) and the attention backends' layouts (backend_layouts.py): the KV cache
groups, their shared attention spec, their layers and the exact element type."""

from __future__ import annotations

from typing import Any

from pdxfer.kv.groups import FULL, SLIDING, STATE, GroupSpec, KVGroups


class UnsupportedKVCache(ValueError):
    """A KV cache configuration this connector version cannot move (named in the message)."""


class UnmovableKVGroups(UnsupportedKVCache):
    """KV cache groups of a kind or shape pdxfer does not move: the instance serves without KV
    transfer (its hybrid KV cache manager stays on)."""


def kv_groups(kv_cache_config: Any) -> KVGroups:
    """The instance's KV cache groups as pdxfer moves them (UnsupportedKVCache for a group kind
    it cannot move, naming the kind): full attention (MLA included), sliding-window attention and
    the running state of Mamba / gated delta-net layers in vLLM's "align" cache mode. With vLLM's
    hybrid KV cache manager off, or for a plain model, that is one full group."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise UnsupportedKVCache("the KV cache config has no KV cache group")
    specs = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise UnmovableKVGroups(f"KV cache group {i} ({name}) is not part of vLLM's transferable KV state")
        if name == "MambaSpec" and len(groups) > 1:
            _check_state_group(i, spec)
            specs.append(GroupSpec(STATE))
            continue
        if len(groups) > 1 and name not in _GROUP_SPECS and hasattr(spec, "num_kv_heads"):
            raise UnmovableKVGroups(f"KV cache group {i} is {name}; in a hybrid model pdxfer moves groups of "
                                    f"{', '.join(sorted(_GROUP_SPECS | {'MambaSpec'}))} only")
        if getattr(spec, "attention_chunk_size", None):
            raise UnmovableKVGroups(f"KV cache group {i} is chunked local attention ({name}); pdxfer moves full "
                                     "and sliding-window attention groups")
        window = getattr(spec, "sliding_window", None)
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
            raise UnmovableKVGroups(f"KV cache group {i} is {name} (recurrent state, not attention KV) in a model "
                                     "without attention layers; pdxfer moves recurrent state only beside "
                                     "attention, so this model's KV stays on each instance")
        if window:
            if getattr(spec, "extra_retained_tokens", 0):
                raise UnmovableKVGroups(f"KV cache group {i} ({name}) retains {spec.extra_retained_tokens} tokens "
                                         "beyond its window; pdxfer moves plain sliding windows")
            specs.append(GroupSpec(SLIDING, int(window)))
        else:
            specs.append(GroupSpec(FULL))
    if all(s.kind == STATE for s in specs):
        raise UnmovableKVGroups("every KV cache group is recurrent state; pdxfer moves recurrent state only "
                                 "beside attention layers")
    return KVGroups(tuple(specs))


def _check_state_group(i: int, spec: Any) -> None:
    """Refuse (naming why) a recurrent group whose running state is not one block per request at
    the table's end: only vLLM's "align" mode without speculative scratch blocks keeps it there."""
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode != "align":
        raise UnmovableKVGroups(f"KV cache group {i} (MambaSpec) caches its state in mode {mode!r}; pdxfer moves "
                                 "recurrent state in vLLM's 'align' mode (prefix caching on), where each block "
                                 "boundary has its own state block")
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if spec_blocks:
        raise UnmovableKVGroups(f"KV cache group {i} (MambaSpec) has {spec_blocks} speculative scratch blocks "
                                 "(speculative decoding); pdxfer moves recurrent state without them")
    checkpoints = int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0)
    if checkpoints:
        raise UnmovableKVGroups(f"KV cache group {i} (MambaSpec) keeps {checkpoints} prefill checkpoint blocks, "
                                 "whose place in the block table pdxfer does not follow; it moves recurrent "
                                 "state without them")


def state_layers(kv_cache_config: Any) -> set[str]:
    """The recurrent layers of a hybrid model: their state lives inside the pages of the tensors
    the attention layers of their slot view, so it moves with those pages."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return set()
    return {n for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec" for n in g.layer_names}


def _attention_groups(kv_cache_config: Any) -> list[Any]:
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return groups
    return [g for g in groups if type(g.kv_cache_spec).__name__ != "MambaSpec"]


# The KV cache specs whose blocks pdxfer moves as a hybrid model's groups (vLLM's class names).
_GROUP_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"})


def attention_spec(kv_cache_config: Any) -> tuple[Any, list[str]]:
    """The attention spec every KV cache group shares and all their layer names, in group order
    (UnsupportedKVCache otherwise: pdxfer plans one block shape for every group)."""
    kv_groups(kv_cache_config)
    groups = _attention_groups(kv_cache_config)
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise UnsupportedKVCache(f"KV cache spec {type(spec).__name__} has no {attr}: not an attention cache")
    shape = _block_shape(spec)
    for i, g in enumerate(groups[1:], 1):
        if _block_shape(g.kv_cache_spec) != shape:
            raise UnmovableKVGroups(f"KV cache group {i} has blocks of {_block_shape(g.kv_cache_spec)} (block size, "
                                     f"KV heads, head size, V head size, dtype), group 0 {shape}; pdxfer moves "
                                     "groups of one block shape")
    page = _page_bytes(spec)
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        state = g.kv_cache_spec
        if type(state).__name__ == "MambaSpec" and page is not None and int(state.page_size_bytes) != page:
            raise UnmovableKVGroups(f"KV cache group {i} (MambaSpec) has pages of {state.page_size_bytes} bytes, "
                                     f"the attention groups {page}; pdxfer moves recurrent state inside "
                                     "attention pages of equal size")
    return spec, [name for g in groups for name in g.layer_names]


def _page_bytes(spec: Any) -> int | None:
    try:
        return int(spec.page_size_bytes)
    except (AttributeError, TypeError, NotImplementedError):
        return None


def _block_shape(spec: Any) -> tuple[Any, ...]:
    return (int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size),
            int(getattr(spec, "head_size_v", None) or spec.head_size), str(spec.dtype))


def segment_layers(kv_cache_config: Any) -> list[str]:
    """The layers that name the KV tensors' segments. With several groups, layer ``j`` of every
    group lives in one tensor (its blocks belong to one group at a time), so the tensor is one
    segment named by the first of those layers in name order, as :func:`pdxfer.kv.layout.
    describe_kv_caches` names it."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return list(groups[0].layer_names)
    sizes = {len(g.layer_names) for g in groups}
    if len(sizes) != 1:
        raise UnmovableKVGroups(f"KV cache groups have {sorted(sizes)} layers; vLLM shares one tensor per layer "
                                 "slot only between groups of equal size")
    # Recurrent layers' views cover only part of a page: an attention layer of the slot names it.
    return [min(names) for names in zip(*(g.layer_names for g in _attention_groups(kv_cache_config)))]


# vLLM's fp8 cache dtypes and the element type each stores ("fp8" is e4m3 on CPU and CUDA).
_FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype_name(spec_dtype: Any, cache_dtype: str | None) -> str:
    """The exact element type of the KV cache. vLLM stores every fp8 variant as uint8, so the
    variant comes from ``--kv-cache-dtype``; another quantized cache dtype is named as vLLM
    names it (no pdxfer test probed one, so it never matches a probed pair)."""
    name = str(spec_dtype).removeprefix("torch.")
    if cache_dtype in (None, "auto", name):
        return name
    return _FP8_CACHE_DTYPES.get(str(cache_dtype), str(cache_dtype))


def derive_kv_dtype(vllm_config: Any, kv_cache_config: Any) -> str:
    """This instance's exact KV element type (see :func:`kv_dtype_name`)."""
    return kv_dtype_name(attention_spec(kv_cache_config)[0].dtype, getattr(vllm_config.cache_config, "cache_dtype", None))
