"""Reference for the native kernel tests: KV blocks kept as logical ``[blocks, parts, tokens, heads, dim]``
tensors, encoded into each physical layout with permutes (no stride arithmetic shared with the code
under test), and run lists applied by plain indexing.
"""

from __future__ import annotations

import torch

from pdxfer import blockgeom as bg

# format -> number of parts (K and V apart or together = 2; a lone K or V = 1)
FORMATS = {"nhd": 1, "hnd": 1, "cpu": 2, "flash_nhd": 2, "flash_hnd": 2, "blocks_first": 2}


def encode(fmt: str, logical: torch.Tensor) -> torch.Tensor:
    """Logical ``[nb, P, B, H, D]`` -> flat physical buffer of the format (same dtype)."""
    nb, _, b, h, d = logical.shape
    if fmt == "nhd":
        phys = logical[:, 0]
    elif fmt == "hnd":
        phys = logical[:, 0].permute(0, 2, 1, 3)
    elif fmt == "cpu":
        k_t = logical[:, 0].permute(0, 2, 3, 1).reshape(nb, h, d * b)  # K transposed: [H, D, B]
        v = logical[:, 1].permute(0, 2, 1, 3).reshape(nb, h, b * d)
        phys = torch.cat([k_t, v], dim=2)  # [nb, H, 2*B*D] == [nb, H, B, 2*D] bytes
    elif fmt == "flash_nhd":
        phys = logical.permute(1, 0, 2, 3, 4)
    elif fmt == "flash_hnd":
        phys = logical.permute(1, 0, 3, 2, 4)
    elif fmt == "blocks_first":
        phys = logical
    else:
        raise AssertionError(fmt)
    return phys.contiguous().reshape(-1)


def geometry(fmt: str, nb: int, b: int, h: int, d: int) -> tuple[bg.BlockGeometry, int]:
    """(geometry, block stride in elements) of ``encode(fmt, ...)``'s buffer."""
    per = b * h * d
    if fmt == "nhd":
        return bg.nhd(b, h, d), per
    if fmt == "hnd":
        return bg.hnd(b, h, d), per
    if fmt == "cpu":
        return bg.cpu_kv(b, h, d), 2 * per
    if fmt == "flash_nhd":
        return bg.kv_pair(bg.nhd(b, h, d), nb * per), per
    if fmt == "flash_hnd":
        return bg.kv_pair(bg.hnd(b, h, d), nb * per), per
    if fmt == "blocks_first":
        return bg.kv_pair(bg.nhd(b, h, d), per), 2 * per
    raise AssertionError(fmt)


def apply_runs(src: torch.Tensor, dst: torch.Tensor, block_runs: list[tuple[int, ...]]) -> None:
    """``block_runs`` rows (src_block, dst_block, src_tok, dst_tok, ntok, src_head, dst_head, nheads)."""
    for sb, db, st, dt, n, sh, dh, nh in block_runs:
        if n and nh:
            dst[db, :, dt:dt + n, dh:dh + nh] = src[sb, :, st:st + n, sh:sh + nh]


def random_logical(nb: int, parts: int, b: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct-enough values per element in any dtype (integers wrap; floats from randn)."""
    g = torch.Generator().manual_seed(seed)
    shape = (nb, parts, b, h, d)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)
