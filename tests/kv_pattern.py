"""KV caches in vLLM's tensor shapes built from, and read back to, logical ``[layers, 2, blocks,
block_size, heads, head_dim]`` tensors (K = 0, V = 1), for conversion tests in-process and between
processes. Encoding uses permutes of whole tensors only, nothing from pdxfer's geometries, so
the code under test and this reference share no stride arithmetic.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pdxfer.device import native
from pdxfer.kv.layout import BLOCKS_FIRST_NHD, CPU, FLASH_HND, FLASH_NHD, KVLayout, describe_kv_caches
from pdxfer.transport.plan import TransferPlan

FORMATS = (CPU, FLASH_NHD, FLASH_HND, BLOCKS_FIRST_NHD)


def layer_names(layers: int) -> list[str]:
    return [f"model.layers.{i}.attn" for i in range(layers)]


def encode(fmt: str, logical: torch.Tensor) -> torch.Tensor:
    """``[L, 2, nb, B, H, D]`` -> one contiguous allocation ``[L, *vLLM's per-layer shape]``."""
    k, v = logical[:, 0], logical[:, 1]  # [L, nb, B, H, D]
    L, nb, b, h, d = k.shape
    if fmt == CPU:  # [nb, H, B, 2D] bytes = per head K^T [D, B] then V [B, D]
        kt = k.permute(0, 1, 3, 4, 2).reshape(L, nb, h, d * b)
        vv = v.permute(0, 1, 3, 2, 4).reshape(L, nb, h, b * d)
        return torch.cat([kt, vv], dim=3).reshape(L, nb, h, b, 2 * d).contiguous()
    if fmt == FLASH_NHD:  # [2, nb, B, H, D]
        return torch.stack([k, v], dim=1).contiguous()
    if fmt == FLASH_HND:  # [2, nb, H, B, D]
        return torch.stack([k.permute(0, 1, 3, 2, 4), v.permute(0, 1, 3, 2, 4)], dim=1).contiguous()
    if fmt == BLOCKS_FIRST_NHD:  # [nb, 2, B, H, D]
        return torch.stack([k, v], dim=2).contiguous()
    raise AssertionError(fmt)


def decode(fmt: str, phys: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode`."""
    if fmt == CPU:
        L, nb, h, b, d2 = phys.shape
        d = d2 // 2
        flat = phys.reshape(L, nb, h, 2 * b * d)
        k = flat[..., : b * d].reshape(L, nb, h, d, b).permute(0, 1, 4, 2, 3)
        v = flat[..., b * d:].reshape(L, nb, h, b, d).permute(0, 1, 3, 2, 4)
    elif fmt == FLASH_NHD:
        k, v = phys[:, 0], phys[:, 1]
    elif fmt == FLASH_HND:
        k, v = phys[:, 0].permute(0, 1, 3, 2, 4), phys[:, 1].permute(0, 1, 3, 2, 4)
    elif fmt == BLOCKS_FIRST_NHD:
        k, v = phys[:, :, 0], phys[:, :, 1]
    else:
        raise AssertionError(fmt)
    return torch.stack([k, v], dim=1)


def as_cache(phys: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``{layer name: tensor}`` dict vLLM registers: views of one allocation."""
    return {name: phys[i] for i, name in enumerate(layer_names(phys.shape[0]))}


def describe(fmt: str, phys: torch.Tensor, block_size: int) -> KVLayout:
    return describe_kv_caches(as_cache(phys), block_size=block_size, kv_format=fmt)


# A holder's seed shifts all its values, so two holders of the same heads serve different bytes.
SEED_STRIDE = 1 << 20


def pattern_value(layer: int, kv: int, token: int, head: int, dim: int, heads: int, head_dim: int,
                  seed: int = 0) -> float:
    """A distinct, exactly representable (float32) value per (layer, K/V, token, model head, dim)
    and holder ``seed`` (exact while below 2**24: keep caches and seeds small)."""
    return float((((layer * 2 + kv) * 4096 + token) * heads + head) * head_dim + dim + 1 + seed * SEED_STRIDE)


def pattern_logical(layers: int, blocks: list[int], num_blocks: int, block_size: int, first_head: int,
                    nheads: int, total_heads: int, head_dim: int, ntokens: int, filler: float = -1.0,
                    seed: int = 0) -> torch.Tensor:
    """Logical float32 KV where token t of a sequence sits in ``blocks[t // block_size]``; heads
    ``[first_head, first_head + nheads)`` of the model's ``total_heads``; ``filler`` elsewhere;
    values as :func:`pattern_value` gives them for ``seed``."""
    out = torch.full((layers, 2, num_blocks, block_size, nheads, head_dim), filler, dtype=torch.float32)
    L = torch.arange(layers).view(layers, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, 2, 1, 1, 1)
    head = (first_head + torch.arange(nheads)).view(1, 1, 1, nheads, 1)
    dim = torch.arange(head_dim).view(1, 1, 1, 1, head_dim)
    for i, b in enumerate(blocks):
        tok = (i * block_size + torch.arange(block_size)).view(1, 1, block_size, 1, 1)
        vals = ((((L * 2 + kv) * 4096 + tok) * total_heads + head) * head_dim + dim + 1
                + seed * SEED_STRIDE).to(torch.float32)
        n = min(block_size, ntokens - i * block_size)
        if n > 0:
            out[:, :, b, :n] = vals[:, :, :n]
    return out


def tokens_of(logical: torch.Tensor, blocks: list[int], block_size: int, t0: int, t1: int) -> torch.Tensor:
    """``[L, 2, tokens, H, D]`` for tokens ``[t0, t1)`` of a sequence stored in ``blocks``."""
    idx = torch.arange(t0, t1)
    b = torch.as_tensor(blocks, dtype=torch.int64)[idx // block_size]
    return logical[:, :, b, idx % block_size]


def raw(t: torch.Tensor) -> native.RawBuffer:
    return native.RawBuffer(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())


def region_bytes(layout: KVLayout, index: int) -> np.ndarray:
    r = layout.regions[index]
    return np.frombuffer((ctypes.c_uint8 * r.nbytes).from_address(r.ptr), dtype=np.uint8)


def play_plan(plan: TransferPlan, remote: KVLayout, local: dict[int, np.ndarray]) -> None:
    """What a transport does with a plan, as plain memory copies (same process)."""
    for r in plan.runs:
        src = region_bytes(remote, r.remote_region)
        local[r.local_region][r.local_offset:r.local_offset + r.nbytes] = src[r.remote_offset:r.remote_offset + r.nbytes]
