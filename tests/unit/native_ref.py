"""Reference for the native kernel tests: KV blocks kept as logical ``[blocks, parts, tokens, heads, dim]``
tensors, encoded into each physical layout with permutes (no stride arithmetic shared with the code
under test), and run lists applied by plain indexing.
"""

from __future__ import annotations

import numpy as np
import torch

from pdxfer.kv import blockgeom as bg

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


# Padded layouts: the formats above with extra elements after a row, a head, a part or a block, so
# that one stride is a little longer than the dims inside it. The kernel merges dims only where
# they are contiguous on both sides; a pad on one side must keep it from merging there, and the pad
# elements are checked to stay untouched. Pads are built with cat of constant fillers (no strides).
PAD_KEYS = {
    "cpu": ("kdim", "vtok", "gap", "head", "block"),  # after a K^T row, a V row, K, a head, a block
    "hnd": ("tok", "head", "gap", "gap0", "block"),  # after a token's D-vector, a head, each part, part 0, a block
    "nhd": ("head", "tok", "gap", "gap0", "block"),  # after a head's D-vector, a token, each part, part 0, a block
    # K and V (and more parts) interleaved element by element, [B, H, D, parts]: after each part's
    # element ("inner": then no stride is 1) and after all parts of one (token, head, dim)
    "ilv": ("inner", "slot", "block"),
}


def _with_pad(x: torch.Tensor, pad: int, fill: int) -> torch.Tensor:
    """``x`` with ``pad`` filler elements appended along its last dim."""
    if pad == 0:
        return x
    return torch.cat([x, torch.full((*x.shape[:-1], pad), fill, dtype=x.dtype)], dim=-1)


def encode_padded(kind: str, logical: torch.Tensor, pads: dict[str, int], fill: int) -> torch.Tensor:
    """Logical ``[nb, P, B, H, D]`` -> flat buffer of the padded format, pads set to ``fill``."""
    nb, parts, b, h, d = logical.shape
    if kind == "ilv":
        x = _with_pad(logical.permute(0, 2, 3, 4, 1).unsqueeze(-1), pads["inner"], fill)  # [nb, B, H, D, P, 1+p]
        x = _with_pad(x.reshape(nb, b, h, d, -1), pads["slot"], fill)
        return _with_pad(x.reshape(nb, -1), pads["block"], fill).reshape(-1)
    if kind == "cpu":
        k_t = _with_pad(logical[:, 0].permute(0, 2, 3, 1), pads["kdim"], fill).reshape(nb, h, -1)  # [H, D, B+p]
        v = _with_pad(logical[:, 1].permute(0, 2, 1, 3), pads["vtok"], fill).reshape(nb, h, -1)  # [H, B, D+p]
        per_head = _with_pad(torch.cat([_with_pad(k_t, pads["gap"], fill), v], dim=2), pads["head"], fill)
        blocks = per_head.reshape(nb, -1)
    else:
        out = []
        for p in range(parts):
            x = logical[:, p]  # [nb, B, H, D]
            if kind == "hnd":
                x = _with_pad(x.permute(0, 2, 1, 3), pads["tok"], fill).reshape(nb, h, -1)  # [H, B*(D+p)]
                x = _with_pad(x, pads["head"], fill)
            else:
                x = _with_pad(x, pads["head"], fill).reshape(nb, b, -1)  # [B, H*(D+p)]
                x = _with_pad(x, pads["tok"], fill)
            out.append(_with_pad(x.reshape(nb, -1), pads["gap"] + (pads["gap0"] if p == 0 else 0), fill))
        blocks = torch.cat(out, dim=1)
    return _with_pad(blocks, pads["block"], fill).reshape(-1)


def padded_geometry(kind: str, parts: int, b: int, h: int, d: int,
                    pads: dict[str, int]) -> tuple[bg.BlockGeometry, int]:
    """(geometry, block stride in elements) of ``encode_padded``'s buffer."""
    if kind == "cpu":
        k_size = d * (b + pads["kdim"]) + pads["gap"]
        hs = k_size + b * (d + pads["vtok"]) + pads["head"]
        g = bg.BlockGeometry(b, h, d, (bg.Part(0, 1, hs, b + pads["kdim"]), bg.Part(k_size, d + pads["vtok"], hs, 1)))
        return g, h * hs + pads["block"]
    if kind == "ilv":
        spacing = 1 + pads["inner"]
        slot = parts * spacing + pads["slot"]
        ps = tuple(bg.Part(p * spacing, h * d * slot, d * slot, slot) for p in range(parts))
        return bg.BlockGeometry(b, h, d, ps), b * h * d * slot + pads["block"]
    if kind == "hnd":
        tok = d + pads["tok"]
        head = b * tok + pads["head"]
        part_size = h * head + pads["gap"]
    else:
        head = d + pads["head"]
        tok = h * head + pads["tok"]
        part_size = b * tok + pads["gap"]
    # Part p starts after p parts and their gaps, part 0's gap being gap + gap0.
    ps = tuple(bg.Part(p * part_size + (pads["gap0"] if p else 0), tok, head, 1) for p in range(parts))
    return bg.BlockGeometry(b, h, d, ps), parts * part_size + pads["gap0"] + pads["block"]


def keep_disjoint(nbd: int, bd: int, hd: int, candidates: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The candidate runs ``(sb, db, stok, dtok, n, sh, dh, nh)`` whose destination (block,
    tokens, heads) ranges do not overlap an earlier one: a scatter writes each element once, so
    the reference does not depend on the kernel's order."""
    used = np.zeros((nbd, bd, hd), dtype=bool)
    runs = []
    for sb, db, stok, dtok, n, sh, dh, nh in candidates:
        if used[db, dtok:dtok + n, dh:dh + nh].any():
            continue
        used[db, dtok:dtok + n, dh:dh + nh] = True
        runs.append((sb, db, stok, dtok, n, sh, dh, nh))
    return runs
