"""Torch implementations of pdxfer.device.native's kernels: the path taken when the C++ library is absent.

Inputs arrive already validated by pdxfer.device.native (same checks for both paths), as flat uint8
tensors over the buffers. One strided ``copy_`` per run and part: Python runs per run here, which
is exactly what the native library exists to avoid.
"""

from __future__ import annotations

import numpy as np
import torch

from pdxfer.kv.blockgeom import BlockGeometry

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray) -> None:
    for so, do, n in runs.tolist():
        if n:
            dst[do:do + n].copy_(src[so:so + n])


def _typed(buf: torch.Tensor, elem_size: int) -> torch.Tensor:
    usable = buf.numel() - buf.numel() % elem_size
    return buf[:usable].view(_INT_OF_SIZE[elem_size])


def scatter_tokens(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray, src_geom: BlockGeometry,
                   dst_geom: BlockGeometry, elem_size: int) -> None:
    s_el, d_el = _typed(src, elem_size), _typed(dst, elem_size)
    hd = src_geom.head_dim
    for so, do, st, dt, ntok, sh, dh, nh in runs.tolist():
        if ntok == 0 or nh == 0:
            continue
        for a, b in zip(src_geom.parts, dst_geom.parts):
            s_view = s_el.as_strided(
                (nh, ntok, hd), (a.head_stride, a.tok_stride, a.dim_stride),
                so // elem_size + a.base + st * a.tok_stride + sh * a.head_stride)
            d_view = d_el.as_strided(
                (nh, ntok, hd), (b.head_stride, b.tok_stride, b.dim_stride),
                do // elem_size + b.base + dt * b.tok_stride + dh * b.head_stride)
            d_view.copy_(s_view)
