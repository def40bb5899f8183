"""Heterogeneous chaos (``ChaosConfig.kv``): real KV caches in vLLM's tensor formats, whose every
value is a function of (token prefix, layer, K/V, position, head, dim), so a reader can check, token
by token, that what it loaded equals what a correct computation gives.

Holders differ in format and block size (one larger than a chunk, one smaller; one the readers
cannot read at all); readers have their own format and block size and load through pdxfer's real
scheduler half (``ReaderPath``: lookup, usable holders, load planning) and worker half
(``WorkerSide``: connect, direct or staged and converted reads, scatter, release), as vLLM drives
them. Prompts share whole chunks with each other but only part of a holder block, the case where
a load that takes a block of the wrong request still gets a valid lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import blake3
import numpy as np
import torch

from pdxfer.kv.keys import KEY_BYTES, IncrementalHasher
from pdxfer.kv.layout import BLOCKS_FIRST_NHD, CPU, CPU_AMX, FLASH_HND, FLASH_NHD, KVLayout, describe_kv_caches
from tests import kv_pattern

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
DTYPE = torch.float32
FILLER = -7.0  # what a reader's blocks hold before a load: never a pattern value (those are >= 0)
ROOT = blake3.blake3(b"pdxfer-chaos-kv").digest(length=KEY_BYTES)
# Shared prefix (in chunks) of prompt p with prompt 0: the cycle mixes 1 chunk (half of a 128-token
# holder block), 3 (one and a half), 2 (a whole block) and 0.
_SHARED_CHUNKS = (6, 1, 3, 2, 0, 1, 3, 5)


@dataclass(frozen=True)
class Side:
    """One process's KV cache: vLLM format and block size."""

    kv_format: str
    block_size: int


# Holder i gets HOLDERS[i % 3]: a block larger than the chunk (64), one smaller in another format,
# and AMX-packed blocks that no reader here may take (they are written in a token order that the
# cpu format would decode wrong, as real AMX packing would be).
HOLDERS = (Side(CPU, 128), Side(FLASH_HND, 32), Side(CPU_AMX, 32))
READERS = (Side(CPU, 32), Side(FLASH_HND, 32), Side(FLASH_NHD, 64))


def holder_side(i: int) -> Side:
    return HOLDERS[i % len(HOLDERS)]


def reader_side(i: int) -> Side:
    return READERS[i % len(READERS)]


def layer_names() -> list[str]:
    return [f"model.layers.{i}.attn" for i in range(LAYERS)]


# ---- prompts, keys, the pattern ------------------------------------------------------------------

@lru_cache(maxsize=None)
def prompt_tokens(seed: int, p: int, chunks: int, chunk_tokens: int) -> tuple[int, ...]:
    """Prompt p: its first chunks shared with prompt 0, the rest its own, plus one token (the last
    token is always computed by the reader, never loaded)."""
    n = chunks * chunk_tokens + 1
    base = np.random.default_rng([seed, 0]).integers(0, 50_000, n)
    own = np.random.default_rng([seed, p + 1]).integers(0, 50_000, n)
    shared = 0 if p == 0 else min(_SHARED_CHUNKS[p % len(_SHARED_CHUNKS)], chunks) * chunk_tokens
    if p == 0:
        return tuple(int(t) for t in base)
    return tuple(int(t) for t in np.concatenate([base[:shared], own[shared:]]))


@lru_cache(maxsize=None)
def chunk_keys(seed: int, p: int, chunks: int, chunk_tokens: int) -> tuple[str, ...]:
    """Hex keys of prompt p's full chunks, as pdxfer's own hasher chains them (shared prefix,
    shared keys)."""
    h = IncrementalHasher(chunk_tokens, ROOT)
    return tuple(k.hex() for k in h.update(list(prompt_tokens(seed, p, chunks, chunk_tokens))))


@lru_cache(maxsize=None)
def _prefix_bases(tokens: tuple[int, ...]) -> np.ndarray:
    """One 22-bit number per position, chained over the tokens up to it: equal only for equal prefixes."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = b"\0" * 8
    for t, tok in enumerate(tokens):
        h = blake3.blake3(h + int(tok).to_bytes(4, "little")).digest(length=8)
        out[t] = int.from_bytes(h, "little") & ((1 << 22) - 1)
    return out


def pattern(tokens: tuple[int, ...], t0: int, t1: int) -> torch.Tensor:
    """Logical KV ``[layers, 2, t1 - t0, heads, head_dim]`` of positions [t0, t1): exact in float32
    (integers below 2^24), distinct per (layer, K/V, head, dim) within a position."""
    base = torch.from_numpy(_prefix_bases(tokens)[t0:t1]).view(1, 1, -1, 1, 1)
    sub = torch.arange(LAYERS * 2 * HEADS * HEAD_DIM, dtype=torch.int64).view(LAYERS, 2, 1, HEADS, HEAD_DIM)
    return ((base * 7 + sub * 1_000_003) % (1 << 24)).to(DTYPE)


# ---- KV tensors in vLLM's formats ----------------------------------------------------------------

def new_cache(side: Side, num_blocks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], KVLayout]:
    """One allocation ``[layers, *vLLM's per-layer shape]`` full of FILLER, its layer views, its layout."""
    b, h, d = side.block_size, HEADS, HEAD_DIM
    fmt = CPU if side.kv_format == CPU_AMX else side.kv_format
    shape = {CPU: (num_blocks, h, b, 2 * d), FLASH_NHD: (2, num_blocks, b, h, d),
             FLASH_HND: (2, num_blocks, h, b, d), BLOCKS_FIRST_NHD: (num_blocks, 2, b, h, d)}[fmt]
    phys = torch.full((LAYERS, *shape), FILLER, dtype=DTYPE)
    caches = {name: phys[i] for i, name in enumerate(layer_names())}
    return phys, caches, describe_kv_caches(caches, block_size=b, kv_format=side.kv_format)


def _encode(fmt: str, logical: torch.Tensor) -> torch.Tensor:
    """``[L, 2, nb, B, H, D]`` -> ``[L, *per-layer shape with nb blocks]``."""
    if fmt == CPU_AMX:  # not the cpu token order: a reader taking these bytes as cpu sees wrong KV
        return kv_pattern.encode(CPU, logical.flip(3))
    return kv_pattern.encode(fmt, logical)


def _block_dim(fmt: str) -> int:
    return 1 if fmt in (CPU, CPU_AMX, BLOCKS_FIRST_NHD) else 2


def write_block(phys: torch.Tensor, side: Side, block: int, tokens: tuple[int, ...], t0: int, t1: int) -> None:
    """Positions [t0, t1) of ``tokens`` into ``block`` (its first position is t0); the rest FILLER."""
    b = side.block_size
    logical = torch.full((LAYERS, 2, 1, b, HEADS, HEAD_DIM), FILLER, dtype=DTYPE)
    logical[:, :, 0, : t1 - t0] = pattern(tokens, t0, t1)
    enc = _encode(side.kv_format, logical)
    phys.select(_block_dim(side.kv_format), block).copy_(enc.select(_block_dim(side.kv_format), 0))


def fill_blocks(phys: torch.Tensor, side: Side, blocks: list[int]) -> None:
    """FILLER into a reader's blocks before a load: nothing left over can pass for loaded KV."""
    idx = torch.as_tensor(blocks, dtype=torch.int64)
    phys.index_fill_(_block_dim(side.kv_format), idx, FILLER)


def read_tokens(phys: torch.Tensor, side: Side, blocks: list[int], t0: int, t1: int) -> torch.Tensor:
    """``[L, 2, t1 - t0, H, D]``: what a reader's blocks hold for positions [t0, t1)."""
    logical = kv_pattern.decode(side.kv_format, phys)
    pos = torch.arange(t0, t1)
    b = torch.as_tensor(blocks, dtype=torch.int64)[pos // side.block_size]
    return logical[:, :, b, pos % side.block_size]


def check_tokens(got: torch.Tensor, tokens: tuple[int, ...], others: dict[int, tuple[int, ...]]) -> dict[str, Any]:
    """Token by token against the pattern. Bad positions come back as ranges, each with what it
    holds instead: another prompt's KV at the same position (``prompt``), the filler (never
    written), or ``garbage``."""
    n = got.shape[2]
    want = pattern(tokens, 0, n)
    bad = ~(got == want).flatten(3).all(dim=3).all(dim=1).all(dim=0)  # [n]
    out: dict[str, Any] = {"tokens": n, "bad": int(bad.sum())}
    if not out["bad"]:
        return out
    runs: list[list[Any]] = []
    for t in torch.nonzero(bad).flatten().tolist():
        what = "garbage"
        tok = got[:, :, t]
        if bool((tok == FILLER).all()):
            what = "filler"
        else:
            for q, other in others.items():
                if len(other) > t and bool((tok == pattern(other, t, t + 1)[:, :, 0]).all()):
                    what = f"prompt {q}"
                    break
        if runs and runs[-1][1] == t and runs[-1][2] == what:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1, what])
    out["bad_ranges"] = runs[:8]
    return out
