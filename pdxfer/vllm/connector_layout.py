"""What the scheduler knows about the KV bytes without seeing a tensor.

On CPU the blocks are those of vLLM's CPU attention (format by ISA, below); on CUDA they are
vLLM's generic ``[B, H, N, C]`` views, described from the attention backend and vLLM's resolved
KV cache layout (:mod:`pdxfer.vllm.backend_layouts`).

The scheduler hashes prompts into keys whose namespace includes the content fingerprint, and
checks every worker's layout fingerprint, but the tensors live in the worker process. So both
are derived here from vLLM's config and the worker checks, when vLLM hands it the real tensors,
that ``describe_kv_caches`` agrees.

Which kernels write the blocks (vLLM's CPU attention "ISA") is asked here exactly as vLLM's CPU
attention builder asks. Blocks whose interior no test probed, and KV whose scales each instance
computes for itself, cannot be named by any key: :func:`kv_refusal` says why, and the connector
then moves no KV (the instance serves, computing every token).
"""

from __future__ import annotations

from typing import Any

from pdxfer.kv.layout import (ATTENTION, CPU, CPU_AMX, MLA, VIEW_FORMATS, KVDescription, KVLayout, Region, Segment,
                           content_fingerprint)
from pdxfer.vllm.keyability import runtime_kv_scales_reason, weights_fingerprint
from pdxfer.vllm.kv_cache_spec import (UnmovableKVGroups, UnsupportedKVCache, attention_spec, derive_kv_dtype, kv_groups,
                                       segment_layers)


def kv_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
        return int(attention_spec(kv_cache_config)[0].block_size)
    return int(vllm_config.cache_config.block_size)


# (ISA, KV dtype) pairs whose block interior a test checked against vLLM's own cache-write kernel
# (tests/unit/test_native_vllm_layout.py probes every pair listed here): pdxfer labels their blocks
# ``cpu`` and converts and head-slices them with :func:`pdxfer.kv.blockgeom.cpu_kv`. vec and vec16 write
# the same interior, so they share the label.
PROBED_CPU_BLOCKS: frozenset[tuple[str, str]] = frozenset(
    (isa, dtype) for isa in ("vec", "vec16") for dtype in ("float32", "bfloat16", "float16"))
# Pairs whose blocks move only byte for byte between instances of the same pair (never converted
# or sliced: see pdxfer.vllm.holder_routes), so no assumption about their interior is made.
BYTE_FOR_BYTE_ONLY: frozenset[tuple[str, str]] = frozenset({("amx", "bfloat16")})

class UnprobedKVBlocks(UnsupportedKVCache):
    """vLLM would write this instance's KV blocks with kernels whose block interior no test probed."""


def cpu_kv_format(isa: str) -> str:
    """Layout format label of vLLM CPU attention blocks written by kernels for ``isa``: the AMX
    kernels pack K and V in tiles, the probed vec/vec16 kernels write the plain CPU block (K
    transposed, then V). Whether pdxfer may use such blocks at all: :func:`check_probed`."""
    return CPU_AMX if isa == "amx" else CPU


def check_probed(isa: str, kv_dtype: str) -> None:
    """Refuse (naming the pair and what to do) blocks whose interior no test probed."""
    if (isa, kv_dtype) in PROBED_CPU_BLOCKS or (isa, kv_dtype) in BYTE_FOR_BYTE_ONLY:
        return
    known = ", ".join(f"{i}/{d}" for i, d in sorted(PROBED_CPU_BLOCKS | BYTE_FOR_BYTE_ONLY))
    raise UnprobedKVBlocks(
        f"vLLM's CPU attention would write this instance's KV blocks with its {isa} kernels in {kv_dtype}, "
        f"and no pdxfer test has checked what those blocks hold (checked ISA/dtype pairs: {known}); "
        "another instance could read them as something else. To move KV, run on a host and with a "
        "--dtype / --kv-cache-dtype that give a checked pair (e.g. without --kv-cache-dtype fp8 on x86)")


def attn_isa(vllm_config: Any, kv_cache_config: Any) -> str:
    """The ISA vLLM's CPU attention runs with: asked as its metadata builder asks, with the
    MODEL dtype (an fp8 cache of a bf16 model on an AMX host is written by the AMX kernels)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec, _ = attention_spec(kv_cache_config)
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    try:
        return _get_attn_isa(vllm_config.model_config.dtype, int(spec.block_size), int(spec.head_size),
                             cache_dtype)
    except NotImplementedError as exc:  # vLLM will refuse to start with this config too
        raise UnsupportedKVCache(f"vLLM's CPU attention has no kernels for this KV cache: {exc}") from exc


def kv_format(vllm_config: Any, kv_cache_config: Any) -> str:
    """The format of this instance's KV blocks, ISA included (an AMX prefill host and a non-AMX
    decode host write different bytes for the same tokens); raises :class:`UnprobedKVBlocks` for
    blocks whose interior no test probed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return gpu_kv_description(vllm_config, kv_cache_config).kv_format
    isa = attn_isa(vllm_config, kv_cache_config)
    check_probed(isa, derive_kv_dtype(vllm_config, kv_cache_config))
    return cpu_kv_format(isa)


def gpu_kv_description(vllm_config: Any, kv_cache_config: Any) -> KVDescription:
    """The description of a CUDA instance's KV blocks, from its attention backend and vLLM's
    resolved KV cache layout (:mod:`pdxfer.vllm.backend_layouts`)."""
    from vllm.platforms import current_platform

    from pdxfer.vllm.backend_layouts import kv_description

    if not current_platform.is_cuda():
        raise UnsupportedKVCache(f"pdxfer derives KV layouts on vLLM's CPU and CUDA platforms, not "
                                 f"{type(current_platform).__name__}")
    return kv_description(vllm_config, kv_cache_config)


def kv_refusal(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why no key can name this instance's KV (a log-ready phrase), or None. Such an instance
    serves as usual but neither publishes nor reads KV."""
    reason = runtime_kv_scales_reason(vllm_config)
    if reason is not None:
        return reason
    try:
        if kv_cache_config is not None:
            attention_spec(kv_cache_config)
            segment_layers(kv_cache_config)
        kv_format(vllm_config, kv_cache_config)
    except (UnprobedKVBlocks, UnmovableKVGroups) as exc:
        return str(exc)
    return None


def derive_layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """The fingerprint ``describe_kv_caches`` will compute for the worker's tensors."""
    fmt = kv_format(vllm_config, kv_cache_config)
    spec, _ = attention_spec(kv_cache_config)
    layers = segment_layers(kv_cache_config)
    if fmt in VIEW_FORMATS:
        desc = gpu_kv_description(vllm_config, kv_cache_config)
        part = "latent" if desc.kind == MLA else "kv"
        segs = tuple(Segment(name, part, 0, 0, 1, 1) for name in layers)
        return KVLayout(fmt, desc.dtype, 1, desc.block_size, desc.kv_heads, desc.head_dim, (Region(0, 1),),
                        segs).fingerprint()
    if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
        raise UnsupportedKVCache("K and V head sizes differ; not supported")
    # Only the fields fingerprint() reads matter; regions/segments stand in for the tensors.
    segs = tuple(Segment(name, "kv", 0, 0, 1, 1) for name in layers)
    layout = KVLayout(fmt, derive_kv_dtype(vllm_config, kv_cache_config), 1, int(spec.block_size),
                      int(spec.num_kv_heads), int(spec.head_size), (Region(0, 1),), segs)
    return layout.fingerprint()


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all TP ranks (the KV cache spec has one rank's share). An MLA
    latent counts as one head that every rank holds whole, so any reader rank reads it from
    any holder rank (:func:`pdxfer.kv.heads.head_sources` with one head)."""
    if _uses_mla(vllm_config):
        return 1
    return int(vllm_config.model_config.get_total_num_kv_heads())


def _uses_mla(vllm_config: Any) -> bool:
    return getattr(vllm_config.model_config, "use_mla", False) is True


def derive_content_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """What the KV holds, whatever its format, block size and TP split: the namespace's part
    (``pdxfer.kv.layout.content_fingerprint``; the worker's handshake is checked against it)."""
    spec, _ = attention_spec(kv_cache_config)
    groups = kv_groups(kv_cache_config)
    # A hybrid model's layers are counted as the layer slots its tensors have (one layer of every
    # group each), as the worker's layout counts them; the groups say the rest.
    layers = segment_layers(kv_cache_config)
    return content_fingerprint(derive_kv_dtype(vllm_config, kv_cache_config), len(layers), total_kv_heads(vllm_config),
                               int(spec.head_size), MLA if _uses_mla(vllm_config) else ATTENTION,
                               groups=groups.signature() if groups.hybrid else "")


def model_identity(vllm_config: Any) -> str:
    """Namespace model id: what vLLM loaded (path or name), its revision, and a fingerprint of
    the weights themselves, so KV computed with other weights under the same name never matches."""
    mc = vllm_config.model_config
    rev = getattr(mc, "revision", None)
    name = f"{mc.model}@{rev}" if rev else str(mc.model)
    return f"{name}#w{weights_fingerprint(str(mc.model), getattr(mc, 'quantization', None))}"
