"""The connector's flow on a CUDA instance of vLLM, without a GPU.

vLLM's platform reports CUDA and the KV tensors come from GPU attention backends (FLASH_ATTN,
TRITON_ATTN, TRITON_MLA) under vLLM's KVCacheLayout members, allocated by vLLM's own
``create_kv_cache_views`` in CPU memory; every GPU-only operation runs on the asynchronous CPU
stand-in (``PDXFER_DEVICE_STANDIN=async:<delay>``, as ``device_ops_for`` selects it for CPU
tensors). A holder computes a request (its KV writes queued on the compute stream), finishes
it, publishes once the write fence passed; a reader of another block size and/or layout member
looks it up and loads it -- straight reads where the bytes agree, staged reads converted by the
stand-in's queued scatter where they do not -- and must hold exactly the holder's tokens.

Not reached here: the TCP transport's pinned bounce buffer. It serves regions whose device is
not "cpu", and these regions are CPU tensors, which report "cpu" truthfully; labelling them
cuda:0 would break the staging's own check that each region tensor is on its region's device.
tests/transport/test_tcp_bounce.py covers that path at the transport. Nothing here ran on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

import pdxfer.device  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.gpu_flow_util import CHUNK, GpuNode, token_kv  # noqa: E402
from tests.vllm.test_connector_layout_gpu import ATTENTION, MLA_BACKEND, _backend, cuda  # noqa: E402,F401

DELAY_S = 0.02  # each queued device operation lands this long after the one before it

BACKENDS = {name: _backend(*where, name) for name, where in ATTENTION.items()}
BACKENDS[MLA_BACKEND[0]] = _backend(*MLA_BACKEND[1], MLA_BACKEND[0])

# (holder backend, layout, block size) -> (reader backend, layout, block size), and whether the
# reader must convert (staged + scatter) or can read straight into place.
CASES = {
    "flash-LBHNC16-to-BLHNC32": (("FLASH_ATTN", "LBHNC", 16), ("FLASH_ATTN", "BLHNC", 32), True),
    "flash-LBHNC16-to-BLHNC16": (("FLASH_ATTN", "LBHNC", 16), ("FLASH_ATTN", "BLHNC", 16), False),
    "flash-BLHNC16-to-LBNHC16": (("FLASH_ATTN", "BLHNC", 16), ("FLASH_ATTN", "LBNHC", 16), True),
    "triton-LBNHC32-to-LHBNC16": (("TRITON_ATTN", "LBNHC", 32), ("TRITON_ATTN", "LHBNC", 16), True),
    "triton-LBNHC16-to-LBNHC16": (("TRITON_ATTN", "LBNHC", 16), ("TRITON_ATTN", "LBNHC", 16), False),
    "mla-BLHNC16-to-LBHNC32": (("TRITON_MLA", "BLHNC", 16), ("TRITON_MLA", "LBHNC", 32), True),
}
NIXL_CASES = ("flash-LBHNC16-to-BLHNC32", "triton-LBNHC16-to-LBNHC16")


@pytest.fixture
def gpu(cuda, monkeypatch, master):
    """Makes GpuNodes on the CUDA-reporting platform with the asynchronous stand-in; closes them,
    then the stand-in's stream threads."""
    monkeypatch.setenv("PDXFER_DEVICE_STANDIN", f"async:{DELAY_S}")
    monkeypatch.setattr(pdxfer.device, "_cache", {})  # a fresh stand-in, read from the environment
    cache = pdxfer.device._cache
    nodes: list[GpuNode] = []

    def make(name: str, backend: str, layout: str, block_size: int, **kw) -> GpuNode:
        cuda(BACKENDS[backend])  # what get_current_attn_backends answers while this node derives
        nodes.append(GpuNode(name, master.address, layout=layout, block_size=block_size,
                             mla=backend == MLA_BACKEND[0], **kw))
        return nodes[-1]

    yield make
    for n in nodes:
        n.close()
    for ops in cache.values():
        ops.close()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (n,), generator=g).tolist()


def _publish_spy(holder: GpuNode) -> list[tuple[bool, int]]:
    """Per publish the holder sends the master: were its KV bytes the step's at that moment, and
    how far had the fence got."""
    seen: list[tuple[bool, int]] = []
    real = holder.sched._hot.publish

    def publish(*a, **kw):
        seen.append((torch.equal(holder.flat, holder.written), holder.sched.fence.completed()))
        return real(*a, **kw)

    holder.sched._hot.publish = publish
    return seen


def _flow(gpu, case: str, transport: str) -> None:
    (hb_name, h_layout, hb), (rb_name, r_layout, rb), converts = CASES[case]
    holder = gpu(f"h-{case}-{transport}", hb_name, h_layout, hb, producer=True, transport=transport)
    reader = gpu(f"r-{case}-{transport}", rb_name, r_layout, rb, producer=False, transport=transport)
    assert holder.ops is reader.ops and holder.ops.asynchronous, "not the asynchronous stand-in"
    seen = _publish_spy(holder)
    toks = _tokens(2 * CHUNK + 21, 7)  # two chunks and a tail

    ids, step = holder.compute("p", toks, seed=11)
    # Right after wait_for_save the step's writes were still queued: its fence had not passed.
    assert holder.fence_after_enqueue < step
    wait_until(lambda: holder.sched.stats.published_chunks >= 3, "the holder never published", timeout=10,
               poll=0.002)
    assert seen and all(landed for landed, _ in seen), "published before the step's KV writes landed"
    assert all(fence >= step for _, fence in seen)
    assert holder.sched.stats.publishes_unfenced == 0

    got = reader.load("d", toks)
    assert got.ext == len(toks) - 1 and not got.errors
    want = token_kv(holder.kv, ids, hb, got.ext)
    assert torch.equal(got.kv_at_report, want), "the loaded blocks are not the holder's tokens when reported"
    assert torch.count_nonzero(want) > 0  # the holder's tokens are its step's, not zeros
    if converts:
        # Converted through staging by scatters queued on the stand-in, reported after each ran.
        assert got.scatters and got.scatters_pending_at_enqueue, "no queued scatter: nothing was asynchronous"
        assert got.scatters_done_at_report, "reported loaded while a scatter was still queued"
    else:
        assert not got.scatters, "a straight read went through staging"
    assert reader.worker.stats.tokens_loaded == got.ext


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gpu_instance_publishes_after_its_fence_and_loads_exact_tokens_over_tcp(gpu, case):
    _flow(gpu, case, "tcp")


@pytest.mark.nixl
@pytest.mark.parametrize("case", NIXL_CASES)
def test_a_gpu_instance_publishes_after_its_fence_and_loads_exact_tokens_over_nixl(gpu, case):
    _flow(gpu, case, "nixl")


def test_a_reader_of_another_backend_family_finds_nothing(gpu):
    """An MLA latent is not attention K/V: a reader of the other kind must not take it, however
    the tokens match (the namespace is the content's)."""
    holder = gpu("h-mla-only", "TRITON_MLA", "LBHNC", 16, producer=True)
    reader = gpu("r-attn-only", "FLASH_ATTN", "LBHNC", 16, producer=False)
    toks = _tokens(2 * CHUNK + 3, 8)
    holder.compute("p", toks, seed=12)
    wait_until(lambda: holder.sched.stats.published_chunks >= 2, "the holder never published", timeout=10)
    t0 = time.monotonic()
    assert reader.load("d", toks).ext == 0
    assert time.monotonic() - t0 < 5
