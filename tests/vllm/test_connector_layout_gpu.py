"""The connector's KV description on CUDA, without a GPU: vLLM's platform patched to report CUDA.

vLLM's real attention backend classes (where importable), real KV cache specs, the real
``CacheConfig.get_resolved_kv_cache_layout`` and real ``KVCacheLayout`` members; only which
backend the layers use is patched in, where NixlConnector asks (``get_current_attn_backends``).
The fingerprint the scheduler derives must be the one the worker computes from the tensors vLLM
allocates (vLLM's own ``create_kv_cache_views``).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        KVCacheTensor, MLAAttentionSpec, compute_layout_strides,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from pdxfer.kv.layout import KV_HEAD_NC, KV_HNC, KV_NHC, MLA_NC, describe_kv_caches  # noqa: E402
from pdxfer.vllm.connector_layout import (UnsupportedKVCache, derive_content_fingerprint,  # noqa: E402
                                         derive_layout_fingerprint, kv_format, total_kv_heads)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
LAYOUTS = [m.name for m in KVCacheLayout]


def _backend(module: str, cls: str, name: str) -> type:
    """vLLM's backend class, or (where its module does not import here, e.g. FlashInfer without
    its wheel) a stand-in with the same name: the description depends on the name alone."""
    try:
        return getattr(importlib.import_module(module), cls)
    except Exception:  # noqa: BLE001 - any import failure of an optional GPU library
        return type(cls, (), {"get_name": staticmethod(lambda: name), "full_cls_name": classmethod(lambda c: name),
                              "get_supported_kernel_block_sizes": staticmethod(lambda spec=None: [16])})


ATTENTION = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
}
MLA_BACKEND = ("TRITON_MLA", ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"))


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)

    def use(backend: type) -> None:
        monkeypatch.setattr(kv_utils, "get_current_attn_backends", lambda vllm_config, layer_names=None: [backend])
    return use


def _configs(layout: str, *, mla: bool = False, block_size: int = 16, heads: int = 4, head_size: int = 64,
             dtype: torch.dtype = torch.bfloat16, **spec_kw):
    cache = CacheConfig(block_size=block_size)
    cache.kv_cache_layout = layout
    if mla:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype, **spec_kw)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
                                 **spec_kw)
    model = SimpleNamespace(use_mla=mla, dtype=dtype, get_total_num_kv_heads=lambda: 2 * heads)
    vc = SimpleNamespace(cache_config=cache, model_config=model)
    return vc, KVCacheConfig(num_blocks=6, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _vllm_tensors(vc, kcc, num_blocks: int = 6) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's allocation gives (one group; as get_kv_cache_config packs it)."""
    spec = kcc.kv_cache_groups[0].kv_cache_spec
    layout = vc.cache_config.get_resolved_kv_cache_layout()
    page = spec.page_size_bytes
    fixed = len(LAYERS) * page if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(LAYERS), layout,
                                                            fixed_strides=(None, fixed, None, None, None))
    tensor = KVCacheTensor(size=len(LAYERS) * page * num_blocks, layers=LAYERS, layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return dict(zip(LAYERS, create_kv_cache_views(raw, spec, num_blocks, layout, tensor)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", sorted(ATTENTION))
def test_attention_backends_start_on_cuda_with_every_layout(cuda, backend, layout):
    cuda(_backend(*ATTENTION[backend], backend))
    vc, kcc = _configs(layout)
    fmt = kv_format(vc, kcc)
    assert fmt == {"LBHNC": KV_HNC, "BLHNC": KV_HNC, "LBNHC": KV_NHC, "BLNHC": KV_NHC,
                   "LHBNC": KV_HEAD_NC, "BHLNC": KV_HEAD_NC}[layout]
    # What the worker computes from vLLM's tensors, told only the format (as the connector tells it).
    worker = describe_kv_caches(_vllm_tensors(vc, kcc), block_size=16, kv_format=fmt, dtype="bfloat16")
    assert worker.fingerprint() == derive_layout_fingerprint(vc, kcc)
    assert worker.content_fingerprint(total_kv_heads(vc)) == derive_content_fingerprint(vc, kcc)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mla_backend_starts_on_cuda_with_every_layout(cuda, layout):
    name, where = MLA_BACKEND
    cuda(_backend(*where, name))
    vc, kcc = _configs(layout, mla=True, head_size=576)
    assert kv_format(vc, kcc) == MLA_NC
    worker = describe_kv_caches(_vllm_tensors(vc, kcc), block_size=16, kv_format=MLA_NC, dtype="bfloat16")
    assert worker.kv_heads == 1 and worker.head_dim == 576 and {s.part for s in worker.segments} == {"latent"}
    assert worker.fingerprint() == derive_layout_fingerprint(vc, kcc)
    # One latent every rank holds whole: the content counts one head whatever the model's heads.
    assert total_kv_heads(vc) == 1
    assert worker.content_fingerprint(1) == derive_content_fingerprint(vc, kcc)


def test_layouts_whose_block_bytes_agree_share_a_fingerprint_and_others_do_not(cuda):
    cuda(_backend(*ATTENTION["FLASH_ATTN"], "FLASH_ATTN"))
    fps = {layout: derive_layout_fingerprint(*_configs(layout)) for layout in LAYOUTS}
    assert fps["LBHNC"] == fps["BLHNC"] and fps["LBNHC"] == fps["BLNHC"] and fps["LHBNC"] == fps["BHLNC"]
    assert len({fps["LBHNC"], fps["LBNHC"], fps["LHBNC"]}) == 3
    # One head: heads inside or outside a block are the same bytes.
    assert len({derive_layout_fingerprint(*_configs(layout, heads=1)) for layout in LAYOUTS}) == 1


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
def test_an_unknown_backend_is_refused_naming_backend_and_layout(cuda, layout):
    cuda(type("Mystery", (), {"get_name": staticmethod(lambda: "MYSTERY_ATTN")}))
    vc, kcc = _configs(layout)
    with pytest.raises(UnsupportedKVCache,
                       match=f"backend MYSTERY_ATTN with KV cache layout {layout}: pdxfer does not know"):
        kv_format(vc, kcc)
    with pytest.raises(UnsupportedKVCache, match="MYSTERY_ATTN"):
        derive_layout_fingerprint(vc, kcc)


def test_packed_content_and_unresolved_layouts_are_refused(cuda):
    cuda(_backend(*ATTENTION["TRITON_ATTN"], "TRITON_ATTN"))
    vc, kcc = _configs("LBNHC", state_content_bytes=1024)
    with pytest.raises(UnsupportedKVCache, match="TRITON_ATTN.*LBNHC.*state_content_bytes"):
        kv_format(vc, kcc)
    vc, kcc = _configs("LBNHC")
    vc.cache_config.kv_cache_layout = None
    with pytest.raises(UnsupportedKVCache, match="not resolved"):
        kv_format(vc, kcc)


def test_packed_mla_cache_dtypes_are_refused(cuda):
    cuda(_backend(*MLA_BACKEND[1], MLA_BACKEND[0]))
    vc, kcc = _configs("BLHNC", mla=True, head_size=576, cache_dtype_str="fp8_ds_mla")
    with pytest.raises(UnsupportedKVCache, match="TRITON_MLA.*BLHNC.*fp8_ds_mla"):
        kv_format(vc, kcc)


def test_an_mla_backend_with_a_multi_head_attention_spec_is_refused(cuda):
    cuda(_backend(*MLA_BACKEND[1], MLA_BACKEND[0]))
    vc, kcc = _configs("LBHNC", heads=4)
    with pytest.raises(UnsupportedKVCache, match="TRITON_MLA.*LBHNC.*latent"):
        kv_format(vc, kcc)


def test_other_gpu_platforms_are_refused_naming_the_platform(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    vc, kcc = _configs("LBHNC")
    with pytest.raises(UnsupportedKVCache, match="CPU and CUDA"):
        kv_format(vc, kcc)


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
def test_the_worker_registers_vllms_tensors_against_the_schedulers_fingerprint(cuda, layout):
    """The worker is built as the connector builds it (format, block size, dtype from the config)
    and accepts vLLM's tensors: what it describes is what the scheduler keyed."""
    from pdxfer.contracts.connector_config import parse_extra_config
    from pdxfer.vllm.connector_layout import derive_kv_dtype
    from pdxfer.vllm.worker.worker_side import LayoutMismatch, WorkerSide

    cuda(_backend(*ATTENTION["FLASH_ATTN"], "FLASH_ATTN"))
    vc, kcc = _configs(layout)
    cfg = parse_extra_config({"master": "127.0.0.1:9", "transport": "tcp", "staging_mib": 1})
    worker = WorkerSide(cfg, node_id="n", rank=0, expected_fingerprint=derive_layout_fingerprint(vc, kcc),
                        block_size=16, kv_format=kv_format(vc, kcc), kv_dtype=derive_kv_dtype(vc, kcc))
    hs = worker.register_kv_caches(_vllm_tensors(vc, kcc))
    try:
        assert hs.kv_format == kv_format(vc, kcc) and worker.layout.num_layers == len(LAYERS)
    finally:
        worker.close()
    # Tensors whose blocks are other bytes than the resolved layout's do not pass as its format.
    # (LBHNC tensors would pass as kv_head_nc, truthfully: one head's [N, C] is one range there too.)
    other = _vllm_tensors(*_configs({"LBNHC": "LBHNC", "BHLNC": "LBNHC"}[layout]))
    worker = WorkerSide(cfg, node_id="n", rank=0, expected_fingerprint=derive_layout_fingerprint(vc, kcc),
                        block_size=16, kv_format=kv_format(vc, kcc), kv_dtype=derive_kv_dtype(vc, kcc))
    try:
        with pytest.raises((LayoutMismatch, ValueError)):
            worker.register_kv_caches(other)
    finally:
        worker.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_a_sliding_window_hybrid_on_cuda_shares_one_segment_per_layer_slot(cuda, backend, layout):
    """With the hybrid KV cache manager, vLLM views one allocation once per group (layer j of
    every group on the same bytes): the worker's description must be the scheduler's, one segment
    per layer slot, in every KV cache layout."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cuda(_backend(*ATTENTION[backend], backend))
    cache = CacheConfig(block_size=16)
    cache.kv_cache_layout = layout
    attn = dict(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    names = [[f"model.layers.{g + 3 * j}.self_attn.attn" for j in range(2)] for g in range(3)]
    specs = [SlidingWindowSpec(**attn, sliding_window=64), SlidingWindowSpec(**attn, sliding_window=64),
             FullAttentionSpec(**attn)]
    kcc = KVCacheConfig(num_blocks=6, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in zip(names, specs)])
    vc = SimpleNamespace(cache_config=cache, model_config=SimpleNamespace(use_mla=False, dtype=torch.bfloat16,
                                                                         get_total_num_kv_heads=lambda: 8))
    resolved = cache.get_resolved_kv_cache_layout()
    page = specs[2].page_size_bytes
    fixed = 2 * page if resolved.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(specs[2], 6, 2, resolved,
                                                            fixed_strides=(None, fixed, None, None, None))
    raw = torch.zeros(2 * page * 6, dtype=torch.int8)
    views: dict[str, torch.Tensor] = {}
    for group, spec in zip(names, specs):
        tensor = KVCacheTensor(size=raw.numel(), layers=group, layer_stride=layer_stride, block_stride=block_stride)
        views.update(zip(group, create_kv_cache_views(raw, spec, 6, resolved, tensor)))
    fmt = kv_format(vc, kcc)
    worker = describe_kv_caches(views, block_size=16, kv_format=fmt, dtype="bfloat16")
    assert {s.layer for s in worker.segments} == {"model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"}
    assert worker.fingerprint() == derive_layout_fingerprint(vc, kcc)
    assert worker.content_fingerprint(8, "sliding64,sliding64,full") == derive_content_fingerprint(vc, kcc)
