"""What vLLM's KV cache config says about the KV bytes, read the same way by the scheduler's
layout (connector_layout.py) and the attention backends' layouts (backend_layouts.py): the KV cache
group's attention spec, its layers and the exact element type."""

from __future__ import annotations

from typing import Any


class UnsupportedKVCache(ValueError):
    """A KV cache configuration this connector version cannot move (named in the message)."""


def attention_spec(kv_cache_config: Any) -> tuple[Any, list[str]]:
    """The one KV cache group's attention spec and its layer names (UnsupportedKVCache otherwise)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise UnsupportedKVCache(f"pdxfer supports one KV cache group (plain attention models), got {len(groups)}")
    g = groups[0]
    spec = g.kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise UnsupportedKVCache(f"KV cache spec {type(spec).__name__} has no {attr}: not an attention cache")
    return spec, list(g.layer_names)


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
