"""Issue 16, holes 2 and 3: what the connector concludes about its KV blocks from vLLM's config.

Real ``VllmConfig`` / ``KVCacheConfig`` objects of the tiny model, vLLM's real ISA chooser and,
as the oracle of which kernels write the blocks, vLLM's real CPU attention metadata builder
(what the engine asks at start). The host's CPU features and architecture are patched where a
case needs another host (AMX, Arm, ...); the chooser itself runs unchanged. No engine is started.
"""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms import CpuArchEnum  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from pdxfer.planning.convert import check_convertible  # noqa: E402
from pdxfer.kv.layout import CPU, LayoutError, describe_kv_caches  # noqa: E402
from pdxfer.vllm.connector_layout import (UnsupportedKVCache, attn_isa, cpu_kv_format,  # noqa: E402
                                         derive_content_fingerprint, kv_format)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # the tiny model's attention layers


@functools.lru_cache(maxsize=None)
def _model_config(model: str, dtype: str) -> ModelConfig:
    return ModelConfig(model=model, dtype=dtype)


def _configs(tiny_model, *, model_dtype: str = "float32", cache_dtype: str = "auto", block_size: int = 32,
             connector: bool = False) -> tuple[VllmConfig, KVCacheConfig]:
    """A VllmConfig and the KVCacheConfig vLLM would derive from it (one full-attention group)."""
    mc = _model_config(str(tiny_model), model_dtype)
    ktc = (KVTransferConfig(kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.vllm",
                            kv_role="kv_both", kv_connector_extra_config={"master": "127.0.0.1:9"})
           if connector else None)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(cache_dtype=cache_dtype, block_size=block_size),
                    kv_transfer_config=ktc)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=mc.get_total_num_kv_heads(),
                             head_size=mc.get_head_size(), dtype=kv_cache_dtype_str_to_dtype(cache_dtype, mc))
    return vc, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _builder_isa(vc: VllmConfig, kcc: KVCacheConfig) -> str:
    """The ISA vLLM's CPU attention really runs with for this config (its metadata builder's)."""
    spec = kcc.kv_cache_groups[0].kv_cache_spec
    with set_current_vllm_config(vc):
        return cpu_attn.CPUAttentionMetadataBuilder(spec, LAYERS, vc, torch.device("cpu")).isa


def _host(monkeypatch, *, amx: bool = False, arch: CpuArchEnum = CpuArchEnum.X86, avx512: bool = True) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(cpu_attn.current_platform, "get_cpu_architecture", lambda: arch)
    monkeypatch.setattr(cpu_attn, "_riscv_supports_rvv", lambda: True)


@pytest.mark.parametrize("model_dtype, cache_dtype, amx", [
    ("bfloat16", "auto", True), ("bfloat16", "auto", False), ("float32", "auto", True),
    ("bfloat16", "fp8", True), ("bfloat16", "fp8_e5m2", True), ("float32", "fp8", True), ("bfloat16", "fp8", False),
])
def test_kv_format_follows_the_isa_vllms_attention_builder_picks(tiny_model, monkeypatch, model_dtype,
                                                                  cache_dtype, amx):
    """pdxfer's format is that of the kernels the builder picked, or pdxfer refuses naming them:
    never the plain ``cpu`` label on blocks another ISA wrote."""
    _host(monkeypatch, amx=amx)
    vc, kcc = _configs(tiny_model, model_dtype=model_dtype, cache_dtype=cache_dtype)
    isa = _builder_isa(vc, kcc)
    assert attn_isa(vc, kcc) == isa
    try:
        fmt = kv_format(vc, kcc)
    except UnsupportedKVCache as exc:
        assert isa in str(exc), (isa, str(exc))
    else:
        assert fmt == cpu_kv_format(isa), (isa, fmt)


def test_each_fp8_variant_has_its_own_content_fingerprint(tiny_model):
    fps = {dt: derive_content_fingerprint(*_configs(tiny_model, cache_dtype=dt))
           for dt in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert fps["fp8"] == fps["fp8_e4m3"]  # vLLM's "fp8" is e4m3: the same numbers
    assert fps["fp8_e4m3"] != fps["fp8_e5m2"]
    assert not any("uint8" in fp for fp in fps.values()), fps
    assert derive_content_fingerprint(*_configs(tiny_model)) not in fps.values()


def test_layouts_of_two_fp8_variants_are_not_convertible():
    buf = torch.zeros(2, 8, 2, 32, 2 * 64, dtype=torch.uint8)  # how vLLM allocates an fp8 CPU cache
    caches = {f"layer.{i}": buf[i] for i in range(2)}
    e4m3 = describe_kv_caches(caches, kv_format=CPU, dtype="float8_e4m3fn")
    e5m2 = describe_kv_caches(caches, kv_format=CPU, dtype="float8_e5m2")
    assert e4m3.dtype == "float8_e4m3fn" and e5m2.dtype == "float8_e5m2"
    assert e4m3.fingerprint() != e5m2.fingerprint()
    assert e4m3.content_fingerprint(2) != e5m2.content_fingerprint(2)
    with pytest.raises(LayoutError, match="dtype"):
        check_convertible(e4m3, e5m2)
    with pytest.raises(LayoutError, match="float32"):  # a 1-byte cache can only be named a 1-byte type
        describe_kv_caches(caches, kv_format=CPU, dtype="float32")


@pytest.mark.parametrize("arch, isa", [
    (CpuArchEnum.ARM, "neon"),
    (CpuArchEnum.POWERPC, "vsx"),
    (CpuArchEnum.S390X, "vxe"),
    (CpuArchEnum.RISCV, "rvv"),
])
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_isas_whose_blocks_no_test_probed_are_refused(tiny_model, monkeypatch, arch, isa, model_dtype):
    _host(monkeypatch, arch=arch)
    vc, kcc = _configs(tiny_model, model_dtype=model_dtype)
    assert _builder_isa(vc, kcc) == isa
    with pytest.raises(UnsupportedKVCache, match=f"{isa}.*{model_dtype}"):
        kv_format(vc, kcc)


def test_fp8_cache_blocks_are_refused_on_a_probed_isa(tiny_model, monkeypatch):
    _host(monkeypatch)
    vc, kcc = _configs(tiny_model, cache_dtype="fp8")
    assert _builder_isa(vc, kcc) == "vec"
    with pytest.raises(UnsupportedKVCache, match="vec.*float8_e4m3fn"):
        kv_format(vc, kcc)


def test_probed_isas_keep_the_cpu_format(tiny_model, monkeypatch):
    _host(monkeypatch)
    for model_dtype, block_size in (("float32", 32), ("bfloat16", 32), ("float16", 16)):
        vc, kcc = _configs(tiny_model, model_dtype=model_dtype, block_size=block_size)
        assert _builder_isa(vc, kcc) == ("vec" if block_size % 32 == 0 else "vec16")
        assert kv_format(vc, kcc) == CPU


# ------------------------------------------------------------------ the connector's start path

@pytest.fixture
def pdxfer_log(caplog, monkeypatch):
    """caplog for the pdxfer logger, which the connector may stop propagating to the root logger
    (each record captured once, whichever the connector does)."""
    logger = logging.getLogger("pdxfer")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="pdxfer"):
        yield caplog
    logger.removeHandler(caplog.handler)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _request() -> Request:
    return Request("r1", list(range(600)), SamplingParams(max_tokens=1), None)


def _prom_value(stats_data: dict, vc: VllmConfig, key: str) -> float:
    """What /metrics would show for ``vllm:pdxfer_<key>`` after vLLM observed ``stats_data``."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pdxfer.vllm.connector_stats import PdxferPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PdxferPromMetrics(vc, types, ["engine"], {0: ["0"]})
    prom.observe(stats_data, 0)
    return reg.get_sample_value(f"vllm:pdxfer_{key}_total", {"engine": "0"}) or 0.0


def test_refused_instance_serves_without_transfer_and_says_so_once(tiny_model, monkeypatch, pdxfer_log):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdxfer.vllm.connector import PdxferConnector

    _host(monkeypatch, arch=CpuArchEnum.ARM)
    vc, kcc = _configs(tiny_model, connector=True)
    sched = PdxferConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    worker = PdxferConnector(vc, KVConnectorRole.WORKER, kcc)
    errors = _errors(pdxfer_log)
    assert len(errors) == 1, errors
    assert "neon" in errors[0] and "float32" in errors[0] and "computed" in errors[0], errors[0]
    # It still serves: every token is computed, nothing is looked up, published or read.
    req = _request()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    assert sched.build_connector_meta(None).loads == []
    assert sched.request_finished(req, [0, 1, 2]) == (False, None)
    worker.register_kv_caches({n: torch.zeros(8, 2, 32, 128) for n in LAYERS})
    assert worker.get_handshake_metadata() is None
    assert worker.get_finished({"r1"}) == (None, None)
    assert worker.get_block_ids_with_load_errors() == set()
    # ... and says so in /metrics (once per instance, from the scheduler).
    first = sched.get_kv_connector_stats()
    assert first is not None and _prom_value(first.data, vc, "kv_transfer_refused") == 1.0
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None
    sched.shutdown()
    worker.shutdown()


def test_an_instance_with_probed_blocks_is_not_refused(tiny_model, monkeypatch, pdxfer_log):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdxfer.vllm.connector import PdxferConnector

    _host(monkeypatch)
    vc, kcc = _configs(tiny_model, connector=True)
    sched = PdxferConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert sched.refusal is None and sched.scheduler_side is not None and not _errors(pdxfer_log)
    stats = sched.get_kv_connector_stats()
    assert stats is None or not stats.data.get("kv_transfer_refused")
    sched.shutdown()


def test_kv_scales_computed_at_run_time_mean_no_key(tiny_model, monkeypatch, pdxfer_log):
    """Scales each instance computes for itself (older vLLM's ``calculate_kv_scales``) make two
    instances' fp8 bytes for the same tokens different numbers: no key can name them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdxfer.vllm.connector import PdxferConnector

    _host(monkeypatch)
    vc, kcc = _configs(tiny_model, connector=True)
    object.__setattr__(vc.cache_config, "calculate_kv_scales", True)
    sched = PdxferConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    errors = _errors(pdxfer_log)
    assert len(errors) == 1 and "calculate_kv_scales" in errors[0], errors
    assert sched.get_num_new_matched_tokens(_request(), 0) == (0, False)
    sched.shutdown()


# ------------------------------------------------------------------ KV scales in the checkpoint

def test_weights_fingerprint_covers_kv_scales_anywhere_in_a_shard(tmp_path):
    from safetensors.torch import save_file

    from pdxfer.vllm.keyability import _SAMPLE_BYTES, weights_fingerprint

    big = torch.zeros(3 * _SAMPLE_BYTES // 4)  # float32: 3 MiB each side of the scale
    tensors = {"a.weight": big, "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5),
               "z.weight": big.clone()}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    # The scale really lies outside the sampled ends (else this test would prove nothing).
    raw = (tmp_path / "model.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    begin, _end = json.loads(raw[8:8 + hlen])["model.layers.0.self_attn.k_proj.k_scale"]["data_offsets"]
    assert _SAMPLE_BYTES < 8 + hlen + begin < len(raw) - _SAMPLE_BYTES
    before = weights_fingerprint(str(tmp_path))
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.25)  # recalibrated scales
    save_file(tensors, tmp_path / "model.safetensors")
    assert weights_fingerprint(str(tmp_path)) != before
    # A quantization config beside the weights (ModelOpt's) says how the scales apply.
    after_scale = weights_fingerprint(str(tmp_path))
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"kv_cache_quant_algo": "FP8"}}')
    assert weights_fingerprint(str(tmp_path)) != after_scale


def _prom_gauges(reports: list, vc: VllmConfig) -> dict[str, float]:
    """The vllm:pdxfer_held_* gauges after vLLM observed each report in turn (one registry)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pdxfer.vllm.connector_stats import PdxferPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PdxferPromMetrics(vc, types, ["engine"], {0: ["0"]})
    for r in reports:
        prom.observe(r.data, 0)
    return {k: reg.get_sample_value(f"vllm:pdxfer_{k}", {"engine": "0"})
            for k in ("held_blocks", "held_chunks", "held_blocks_cap")}


def test_held_gauges_reach_metrics_when_they_change_and_back_to_zero(tiny_model, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.block_pool import BlockPool

    from pdxfer.vllm.connector import PdxferConnector

    _host(monkeypatch)
    vc, kcc = _configs(tiny_model, connector=True)
    sched = PdxferConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        sched.scheduler_side.bind_block_pool(BlockPool(32, True, 32))
        first = sched.get_kv_connector_stats()  # nothing happened yet: the gauges still appear once
        assert first is not None and not first.is_empty()
        assert sched.get_kv_connector_stats() is None  # unchanged: nothing to send
        holder = sched.scheduler_side.holder
        holder._held = {b"k1": None, b"k2": None}  # what two published chunks of 3 blocks leave
        holder._held_block_refs = {1: 1, 2: 1, 3: 1}
        second = sched.get_kv_connector_stats()
        holder._held, holder._held_block_refs = {}, {}  # both freed: 0 must reach /metrics too
        third = sched.get_kv_connector_stats()
        assert third is not None
        cap = int(0.5 * 32)  # max_held_fraction's default of the pool's blocks
        assert _prom_gauges([first], vc) == {"held_blocks": 0, "held_chunks": 0, "held_blocks_cap": cap}
        assert _prom_gauges([first, second], vc) == {"held_blocks": 3, "held_chunks": 2, "held_blocks_cap": cap}
        assert _prom_gauges([first, second, third], vc) == {"held_blocks": 0, "held_chunks": 0,
                                                            "held_blocks_cap": cap}
        # vLLM sums reports over a logging interval: a gauge keeps the newest report's value.
        acc = sched.build_kv_connector_stats(dict(first.data)).aggregate(second).aggregate(third)
        assert acc.data["held_blocks"] == 0 and acc.data["held_blocks_cap"] == cap
    finally:
        sched.shutdown()


def test_the_connector_exports_what_it_declares(tiny_model) -> None:
    """docs/metrics.md is rendered from CONNECTOR_METRICS: the exporter must build exactly those."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pdxfer.contracts.connector_metric_defs import CONNECTOR_METRICS
    from pdxfer.vllm.connector_stats import PdxferPromMetrics

    vc, _ = _configs(tiny_model, connector=True)
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    PdxferPromMetrics(vc, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    families = {(f.name, f.type, f.documentation) for f in reg.collect()}
    assert families == {(d.name, d.kind, d.help) for d in CONNECTOR_METRICS}


def test_every_counter_the_connector_keeps_is_exported() -> None:
    """A counter added to the scheduler's or a worker's stats must reach /metrics (and so
    docs/metrics.md): the stats pipeline drops keys it does not know."""
    from dataclasses import fields

    from pdxfer.contracts.connector_metric_defs import COUNTER_KEYS
    from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats
    from pdxfer.vllm.worker.worker_stats import WorkerStats

    kept = {f.name for cls in (SchedulerStats, WorkerStats) for f in fields(cls) if f.type in (int, "int")}
    assert kept and kept <= set(COUNTER_KEYS), sorted(kept - set(COUNTER_KEYS))
