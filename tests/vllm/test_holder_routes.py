"""Which holder ranks and heads a reader rank reads, and how (pdxfer.vllm.holder_routes): pure
decisions over layouts described from tensors in vLLM's shapes."""

from __future__ import annotations

import pytest
import torch

from pdxfer.kv.layout import CPU, CPU_AMX, FLASH_HND, FLASH_NHD
from pdxfer.vllm.holder_routes import NotReadable, Route, routes
from tests.kv_pattern import describe

C = 256


def lay(fmt: str = CPU, heads: int = 2, bs: int = 128, dtype: torch.dtype = torch.bfloat16, blocks: int = 4):
    logical = torch.zeros(2, 2, blocks, bs, heads, 16, dtype=dtype)
    from tests.kv_pattern import encode

    layout = describe(CPU if fmt == CPU_AMX else fmt, encode(CPU if fmt == CPU_AMX else fmt, logical), bs)
    if fmt == CPU_AMX:  # same shape as CPU; only the ISA tells them apart
        import dataclasses

        layout = dataclasses.replace(layout, kv_format=CPU_AMX)
    return layout


def r(holders, local, reader_tp=1, rank=0, total=4, staging=True, holder_total=None):
    return routes("h", holders, total if holder_total is None else holder_total, local, reader_tp, rank, total,
                  staging=staging, chunk_tokens=C)


def test_same_layout_same_tp_is_direct():
    assert r([lay(heads=4)], lay(heads=4)) == [Route(0, 0, 0, 4, True)]
    assert r([lay(heads=2), lay(heads=2)], lay(heads=2), reader_tp=2, rank=1) == [Route(1, 0, 0, 2, True)]


def test_tp_mismatch_reads_head_slices_straight_between_head_major_blocks():
    # TP1 reader, TP2 holder: half the heads from each holder rank; a head is a byte range of a
    # CPU block, so both READs go straight into place.
    assert r([lay(heads=2), lay(heads=2)], lay(heads=4)) == [Route(0, 0, 0, 2, True), Route(1, 0, 2, 2, True)]
    # TP2 reader rank 1, TP1 holder: its half of the holder's one rank.
    assert r([lay(heads=4)], lay(heads=2), reader_tp=2, rank=1) == [Route(0, 2, 0, 2, True)]
    # TP4 reader of a 2-head model (heads replicated): rank 3 holds head 1.
    assert r([lay(heads=2)], lay(heads=1), reader_tp=4, rank=3, total=2) == [Route(0, 1, 0, 1, True)]
    assert r([lay(fmt=FLASH_HND, heads=4)], lay(fmt=FLASH_HND, heads=2), reader_tp=2, rank=1) == [
        Route(0, 2, 0, 2, True)]


def test_tp_mismatch_converts_where_heads_interleave_or_sizes_differ():
    # Flash NHD interleaves heads per token: a slice is staged and scattered.
    assert r([lay(fmt=FLASH_NHD, heads=2)] * 2, lay(fmt=FLASH_NHD, heads=4)) == [
        Route(0, 0, 0, 2, False), Route(1, 0, 2, 2, False)]
    assert r([lay(heads=4, bs=64)], lay(heads=2), reader_tp=2, rank=0) == [Route(0, 0, 0, 2, False)]


@pytest.mark.parametrize("holder, local", [
    (dict(fmt=FLASH_NHD), dict(fmt=CPU)),
    (dict(fmt=CPU, bs=64), dict(fmt=FLASH_HND, bs=128)),
])
def test_other_format_or_block_size_converts(holder, local):
    assert r([lay(heads=4, **holder)], lay(heads=4, **local)) == [Route(0, 0, 0, 4, False)]


@pytest.mark.parametrize("holder, local, kw, said", [
    (dict(dtype=torch.float16), dict(), {}, "holds KV as float16, this reader as bfloat16"),
    (dict(fmt=CPU_AMX), dict(), {}, "writes cpu_amx blocks .*this reader cpu .*byte for byte"),
    (dict(fmt=FLASH_NHD), dict(), dict(staging=False), "needs conversion .* staging_mib is 0"),
    (dict(bs=96), dict(), {}, "block size 96, which neither divides nor is a multiple of chunk_tokens 256"),
    (dict(), dict(), dict(holder_total=8), "holder h has 8 KV heads in all, this reader 4"),
])
def test_refusals_name_both_sides(holder, local, kw, said):
    with pytest.raises(NotReadable, match=said):
        r([lay(heads=4, **holder)], lay(heads=4, **local), **kw)


def test_amx_reads_amx_byte_for_byte():
    assert r([lay(fmt=CPU_AMX, heads=4)], lay(fmt=CPU_AMX, heads=4)) == [Route(0, 0, 0, 4, True)]
    with pytest.raises(NotReadable, match="cpu_amx"):  # but never sliced or converted
        r([lay(fmt=CPU_AMX, heads=2)] * 2, lay(fmt=CPU_AMX, heads=4))
