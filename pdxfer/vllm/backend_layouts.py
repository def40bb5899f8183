"""Which KV blocks vLLM's GPU attention backends write, from vLLM's own descriptors.

vLLM allocates every attention cache the same way whatever the backend: one backing allocation
viewed per layer as ``[B, H, N, C]`` under one :class:`KVCacheLayout` permutation that the engine
resolves for the whole model (``cache_config.get_resolved_kv_cache_layout()``), C being K then V
of one token and head (``head_size + head_size_v`` elements) or, for MLA, one latent
(``kv_lora_rank + rope`` elements, one "head"). So pdxfer's description needs which kind of
backend runs (the same backends NixlConnector asks for, via ``get_current_attn_backends``), the
layout name and the KV cache spec; no tensor shape is guessed.

Backends listed here write plain K/V or latent elements into those views. Anything else (other
backends, packed or padded pages, per-token scales inside the content, kernel blocks smaller
than vLLM's blocks) is refused at start with :class:`UnsupportedKVCache` naming backend and layout.
"""

from __future__ import annotations

from typing import Any

from pdxfer.kv.layout import ATTENTION, MLA, KVDescription, LayoutError
from pdxfer.vllm.kv_cache_spec import UnsupportedKVCache, attention_spec, derive_kv_dtype

# Backends whose kernels read and write K and V elements in vLLM's generic views.
ATTENTION_BACKENDS: frozenset[str] = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"})
# MLA backends whose cache is one dense latent per token (the sparse and DeepSeek-V4 backends keep
# indexer caches and packed fp8 pages, which are not described here).
MLA_BACKENDS: frozenset[str] = frozenset({"FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA",
                                          "CUTLASS_MLA"})


def backend_names(vllm_config: Any, layer_names: list[str]) -> list[str]:
    """Names of the attention backends the KV layers use, as NixlConnector asks for them."""
    from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils

    return sorted({b.get_name() for b in kv_utils.get_current_attn_backends(vllm_config, layer_names)})


def resolved_layout_name(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """vLLM's KVCacheLayout for this instance (resolved once by the engine before allocation)."""
    try:
        return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except ValueError:
        name = getattr(kv_cache_config, "kv_cache_layout", None)
        if name:
            return str(name)
        raise UnsupportedKVCache("vLLM has not resolved its KV cache layout yet, so pdxfer cannot tell where "
                                 "the KV blocks lie") from None


def _refuse(backend: str, layout: str, why: str) -> UnsupportedKVCache:
    return UnsupportedKVCache(f"pdxfer cannot move the KV of attention backend {backend} with KV cache layout "
                              f"{layout}: {why}")


def _check_plain_content(spec: Any, backend: str, layout: str) -> None:
    """C must be plain K/V (or latent) elements: no padded pages, packed head slots or in-page scales."""
    for attr in ("page_size_padded", "num_head_slots", "state_content_bytes"):
        if getattr(spec, attr, None) is not None:
            raise _refuse(backend, layout, f"its KV cache spec sets {attr} (packed or padded pages)")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise _refuse(backend, layout, f"one cache state covers {spec.tokens_per_state} tokens")
    packed = getattr(spec, "cache_dtype_str", None)
    if packed is not None and str(packed) not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"):
        raise _refuse(backend, layout, f"KV cache dtype {packed} packs values and scales into each token's entry")
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and int(mode) not in (0, 1):  # NONE, FP8_PER_TENSOR (vLLM's KVQuantMode)
        raise _refuse(backend, layout, f"KV quantization {getattr(mode, 'name', mode)} keeps scales or "
                                       "packed values in the blocks")


def _check_whole_blocks(vllm_config: Any, spec: Any, layer_names: list[str], backend: str, layout: str) -> None:
    """Refuse where vLLM would split each block into smaller kernel blocks (layer-outermost layouts
    only): the views then hold kernel blocks, not the blocks the scheduler hands out."""
    if layout.startswith("B"):
        return  # vLLM never splits block-outermost blocks
    try:
        from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils
        from vllm.v1.worker.utils import select_common_block_size

        backends = kv_utils.get_current_attn_backends(vllm_config, layer_names)
        kernel = select_common_block_size(int(spec.block_size), backends, [spec] * len(backends))
    except (ImportError, AttributeError, TypeError):
        return  # nothing to ask; describe_kv_caches still refuses kernel-block views at registration
    except ValueError as exc:
        raise _refuse(backend, layout, f"vLLM finds no kernel block size for it: {exc}") from exc
    if kernel != int(spec.block_size):
        raise _refuse(backend, layout, f"vLLM splits each {spec.block_size}-token block into {kernel}-token kernel "
                                       f"blocks; start vLLM with --block-size {kernel}")


def kv_description(vllm_config: Any, kv_cache_config: Any) -> KVDescription:
    """pdxfer's description of this instance's KV blocks on a GPU platform, or
    :class:`UnsupportedKVCache` naming the backend and layout it cannot describe."""
    spec, layers = attention_spec(kv_cache_config)
    layout = resolved_layout_name(vllm_config, kv_cache_config)
    names = backend_names(vllm_config, layers)
    if len(names) != 1:
        raise UnsupportedKVCache(f"pdxfer moves the KV of one attention backend; the KV layers use "
                                 f"{', '.join(names) or 'none'} (KV cache layout {layout})")
    (backend,) = names
    if backend in ATTENTION_BACKENDS:
        kind = ATTENTION
        if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
            raise _refuse(backend, layout, f"K head size {spec.head_size} and V head size {spec.head_size_v} differ")
    elif backend in MLA_BACKENDS:
        kind = MLA
        if getattr(spec, "head_size_v", None) != 0 or int(spec.num_kv_heads) != 1:
            raise _refuse(backend, layout, f"an MLA backend with a {type(spec).__name__} of {spec.num_kv_heads} "
                                           "KV heads is not one latent per token")
    else:
        known = ", ".join(sorted(ATTENTION_BACKENDS | MLA_BACKENDS))
        raise _refuse(backend, layout, f"pdxfer does not know the blocks this backend writes (known backends: "
                                       f"{known})")
    _check_plain_content(spec, backend, layout)
    _check_whole_blocks(vllm_config, spec, layers, backend, layout)
    try:
        return KVDescription(kind, layout, int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size),
                             derive_kv_dtype(vllm_config, kv_cache_config))
    except LayoutError as exc:
        raise _refuse(backend, layout, str(exc)) from exc


__all__ = ["ATTENTION_BACKENDS", "MLA_BACKENDS", "backend_names", "kv_description", "resolved_layout_name"]
