"""What the scheduler knows about the KV bytes without seeing a tensor.

The scheduler hashes prompts into keys whose namespace includes the layout fingerprint, but
the tensors live in the worker process. So the fingerprint is derived here from vLLM's config
and the worker checks, when vLLM hands it the real tensors, that ``describe_kv_caches`` agrees.
"""

from __future__ import annotations

from typing import Any

from pdxfer.layout import CPU, CPU_AMX, KVLayout, Region, Segment, content_fingerprint
from pdxfer.vllm.keyability import weights_fingerprint


class UnsupportedKVCache(ValueError):
    """A KV cache configuration this connector version cannot move (named in the message)."""


def _spec(kv_cache_config: Any) -> tuple[Any, list[str]]:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise UnsupportedKVCache(f"pdxfer supports one KV cache group (plain attention models), got {len(groups)}")
    g = groups[0]
    spec = g.kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise UnsupportedKVCache(f"KV cache spec {type(spec).__name__} has no {attr}: not an attention cache")
    return spec, list(g.layer_names)


def kv_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
        return int(_spec(kv_cache_config)[0].block_size)
    return int(vllm_config.cache_config.block_size)


def cpu_kv_format(isa: str) -> str:
    """Layout format of vLLM CPU attention blocks written by kernels for ``isa``: the AMX kernels
    pack K and V in tiles, every other ISA writes the plain CPU block (K transposed, then V)."""
    return CPU_AMX if isa == "amx" else CPU


def kv_format(vllm_config: Any, kv_cache_config: Any) -> str:
    """The format of this instance's KV blocks, ISA included (an AMX prefill host and a non-AMX
    decode host write different bytes for the same tokens)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise UnsupportedKVCache("this pdxfer connector version derives KV layouts for vLLM's CPU "
                                 "backend only")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec, _ = _spec(kv_cache_config)
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    return cpu_kv_format(_get_attn_isa(spec.dtype, int(spec.block_size), int(spec.head_size), cache_dtype))


def derive_layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """The fingerprint ``describe_kv_caches`` will compute for the worker's tensors."""
    fmt = kv_format(vllm_config, kv_cache_config)
    spec, layers = _spec(kv_cache_config)
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise UnsupportedKVCache("K and V head sizes differ; not supported")
    dtype = str(spec.dtype).removeprefix("torch.")
    # Only the fields fingerprint() reads matter; regions/segments stand in for the tensors.
    segs = tuple(Segment(name, "kv", 0, 0, 1, 1) for name in layers)
    layout = KVLayout(fmt, dtype, 1, int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size),
                      (Region(0, 1),), segs)
    return layout.fingerprint()


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all TP ranks (the KV cache spec has one rank's share)."""
    return int(vllm_config.model_config.get_total_num_kv_heads())


def derive_content_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """What the KV holds, whatever its format, block size and TP split: the namespace's part
    (``pdxfer.layout.content_fingerprint``; the worker's handshake is checked against it)."""
    spec, layers = _spec(kv_cache_config)
    dtype = str(spec.dtype).removeprefix("torch.")
    return content_fingerprint(dtype, len(layers), total_kv_heads(vllm_config), int(spec.head_size))


def model_identity(vllm_config: Any) -> str:
    """Namespace model id: what vLLM loaded (path or name), its revision, and a fingerprint of
    the weights themselves, so KV computed with other weights under the same name never matches."""
    mc = vllm_config.model_config
    rev = getattr(mc, "revision", None)
    name = f"{mc.model}@{rev}" if rev else str(mc.model)
    return f"{name}#w{weights_fingerprint(str(mc.model), getattr(mc, 'quantization', None))}"
