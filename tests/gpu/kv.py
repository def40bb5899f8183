"""KV tensors shaped like vLLM's, in VRAM (or host memory for the stand-in), with known bytes.

Both processes of a move build the holder's tensors from the same seed, so the reader knows
every byte it must receive without a second channel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from pdxfer import layout as L
from pdxfer.device import flat_bytes
from pdxfer.plan import TransferPlan
from pdxfer.transport.base import RegisteredRegion

Shape = Callable[[int, int, int, int], tuple[int, ...]]  # (num_blocks, block_size, heads, head_dim)

# format -> (per-layer tensor shape, index of the num_blocks dim): as vLLM allocates them on GPUs.
VRAM_LAYOUTS: dict[str, tuple[Shape, int]] = {
    L.FLASH_NHD: (lambda nb, b, h, d: (2, nb, b, h, d), 1),
    L.FLASH_HND: (lambda nb, b, h, d: (2, nb, h, b, d), 1),
    L.BLOCKS_FIRST_NHD: (lambda nb, b, h, d: (nb, 2, b, h, d), 0),
    # >>> KVCacheLayout members being added to pdxfer/layout.py: one entry per member here, with
    # >>> the tensor shape vLLM allocates for it. Until then each new format prints a SKIP line.
}
# Formats that never live in VRAM (vLLM's CPU backend).
HOST_ONLY = frozenset({L.CPU, L.CPU_AMX})


@dataclass(frozen=True)
class KVSpec:
    kv_format: str
    layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def block_dim(self) -> int:
        return VRAM_LAYOUTS[self.kv_format][1]

    def shape(self) -> tuple[int, ...]:
        return VRAM_LAYOUTS[self.kv_format][0](self.num_blocks, self.block_size, self.heads, self.head_dim)

    def layer_bytes(self) -> int:
        n = torch.empty(0, dtype=self.dtype).element_size()
        for s in self.shape():
            n *= s
        return n


def layer_names(spec: KVSpec) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(spec.layers)]


def make_kv(spec: KVSpec, device: str, seed: int) -> dict[str, torch.Tensor]:
    """One allocation per layer (as vLLM does on GPUs), each filled with seeded random bytes."""
    out = {}
    for i, name in enumerate(layer_names(spec)):
        t = torch.empty(spec.shape(), dtype=spec.dtype, device=device)
        flat = flat_bytes(t)
        g = torch.Generator(device=device).manual_seed(seed * 1009 + i)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g, device=device))
        out[name] = t
    return out


def describe(spec: KVSpec, kv: dict[str, torch.Tensor]) -> L.KVLayout:
    return L.describe_kv_caches(kv, block_size=spec.block_size, kv_format=spec.kv_format)


def has_tensor_field() -> bool:
    """Whether RegisteredRegion carries the region's tensor (what the TCP transport's bounce
    buffer path for CUDA memory needs)."""
    return any(f.name == "tensor" for f in dataclasses.fields(RegisteredRegion))


def format_seed(seed: int, position: int) -> int:
    """Each format of a holder gets its own bytes, so a read served from the wrong one shows."""
    return seed + 101 * position


def registered_regions(layout: L.KVLayout, kv: dict[str, torch.Tensor],
                       first_index: int = 0) -> list[RegisteredRegion]:
    """The layout's regions for ``Transport.register`` as indices ``first_index...`` (several
    layouts share one transport), each with its flat tensor where the interface takes one."""
    by_ptr = {t.untyped_storage().data_ptr(): t for t in kv.values()}
    with_tensor = has_tensor_field()
    out = []
    for r in layout.regions:
        extra = {"tensor": flat_bytes(by_ptr[r.ptr])} if with_tensor else {}
        out.append(RegisteredRegion(first_index + r.index, r.ptr, r.nbytes, r.device, **extra))
    return out


def shift_plan(plan: TransferPlan, remote_first: int, local_first: int) -> TransferPlan:
    """``plan`` (made between two layouts' own region indices) for transports on which those
    layouts' regions start at ``remote_first`` / ``local_first``."""
    runs = tuple(dataclasses.replace(r, remote_region=r.remote_region + remote_first,
                                     local_region=r.local_region + local_first) for r in plan.runs)
    return TransferPlan(runs, plan.uncoalesced_runs)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim widened to bytes: block indexing stays the same, comparisons and
    copies are bit exact (no float NaN canonicalisation)."""
    return t.view(torch.uint8)


def expected_after_read(spec: KVSpec, remote: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                        remote_blocks: list[int], local_blocks: list[int]) -> dict[str, torch.Tensor]:
    """``local`` with block ``local_blocks[i]`` of every layer replaced by the holder's block
    ``remote_blocks[i]``: by tensor indexing, independent of pdxfer's layout and plan code."""
    dim = spec.block_dim
    out = {}
    for name, lt in local.items():
        dev = lt.device
        want = byte_view(lt).clone()
        src = byte_view(remote[name]).index_select(dim, torch.tensor(remote_blocks, device=dev))
        want.index_copy_(dim, torch.tensor(local_blocks, device=dev), src)
        out[name] = want
    return out
