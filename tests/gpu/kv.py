"""KV tensors shaped like vLLM's, in VRAM (or host memory for the stand-in), with known bytes.

Both processes of a move build the holder's tensors from the same seed, so the reader knows
every byte it must receive without a second channel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from pdxfer.kv import layout as L
from pdxfer.device import flat_bytes
from pdxfer.transport.plan import TransferPlan
from pdxfer.transport.base import RegisteredRegion

Shape = Callable[[int, int, int, int], tuple[int, ...]]  # (num_blocks, block_size, heads, head_dim)


@dataclass(frozen=True)
class VramLayout:
    """How vLLM allocates one cache in VRAM. ``shape``: one allocation per layer of that shape
    (the shape-detected formats). ``vllm_layout``: a KVCacheLayout member instead, whose layers
    are ``[B, H, N, C]`` views of one allocation (:func:`_vllm_views`), described the way the
    connector does, from a :class:`pdxfer.kv.layout.KVDescription`."""

    kv_format: str
    shape: Shape | None = None
    block_dim: int = 0  # index of the num_blocks dim of a layer's tensor
    vllm_layout: str | None = None
    kind: str = L.ATTENTION


def _view(vllm_layout: str, kind: str = L.ATTENTION) -> VramLayout:
    # The format pdxfer gives the member's blocks with several heads (with one head every
    # member's blocks are kv_hnc; the check's specs have more).
    fmt = L.KVDescription(kind, vllm_layout, 1, 1 if kind == L.MLA else 2, 1, "bfloat16").kv_format
    return VramLayout(fmt, vllm_layout=vllm_layout, kind=kind)


# name -> how vLLM allocates it on GPUs. The name is what a move's PASS/FAIL line says: the
# pdxfer format, and for vLLM's views also the KVCacheLayout member (LBHNC and BLHNC share a
# format; only their blocks' strides differ).
VRAM_LAYOUTS: dict[str, VramLayout] = {
    L.FLASH_NHD: VramLayout(L.FLASH_NHD, lambda nb, b, h, d: (2, nb, b, h, d), 1),
    L.FLASH_HND: VramLayout(L.FLASH_HND, lambda nb, b, h, d: (2, nb, h, b, d), 1),
    L.BLOCKS_FIRST_NHD: VramLayout(L.BLOCKS_FIRST_NHD, lambda nb, b, h, d: (nb, 2, b, h, d), 0),
    # vLLM's KVCacheLayout members: layer-outermost, block-outermost (one block of every layer
    # adjacent), heads outside blocks (one segment per layer and head), and an MLA latent.
    **{f"{v.kv_format}/{v.vllm_layout}": v for v in (_view("LBHNC"), _view("BLHNC"), _view("LHBNC"),
                                                       _view("LBHNC", L.MLA))},
}
# Formats that never live in VRAM (vLLM's CPU backend).
HOST_ONLY = frozenset({L.CPU, L.CPU_AMX})


@dataclass(frozen=True)
class KVSpec:
    layout: str  # a VRAM_LAYOUTS name
    layers: int
    num_blocks: int
    block_size: int
    heads: int  # KV heads of attention layouts; an MLA latent has none (one per token)
    head_dim: int  # of K and of V; the latent's width for MLA
    dtype: torch.dtype = torch.bfloat16

    @property
    def vram(self) -> VramLayout:
        return VRAM_LAYOUTS[self.layout]

    @property
    def kv_format(self) -> str:
        return self.vram.kv_format

    @property
    def block_dim(self) -> int:
        return self.vram.block_dim

    @property
    def kv_heads(self) -> int:
        return 1 if self.vram.kind == L.MLA else self.heads

    @property
    def content(self) -> int:
        """Elements of C in a view: K then V of one token and head, or one latent."""
        return self.head_dim if self.vram.kind == L.MLA else 2 * self.head_dim

    def shape(self) -> tuple[int, ...]:
        """One layer's tensor: its allocation, or its [B, H, N, C] view."""
        v = self.vram
        if v.shape is not None:
            return v.shape(self.num_blocks, self.block_size, self.heads, self.head_dim)
        return (self.num_blocks, self.kv_heads, self.block_size, self.content)

    def layer_bytes(self) -> int:
        n = torch.empty(0, dtype=self.dtype).element_size()
        for s in self.shape():
            n *= s
        return n

    def description(self) -> L.KVDescription:
        """What the attention backend and vLLM's resolved layout tell the connector."""
        v = self.vram
        assert v.vllm_layout is not None, f"{self.layout} is not one of vLLM's views"
        return L.KVDescription(v.kind, v.vllm_layout, self.block_size, self.kv_heads, self.head_dim,
                               str(self.dtype).removeprefix("torch."))


def layer_names(spec: KVSpec) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(spec.layers)]


def _vllm_views(spec: KVSpec, device: str) -> dict[str, torch.Tensor]:
    """vLLM's placement of a KVCacheLayout member, with torch alone (the GPU machine has no
    vLLM): one allocation whose dims are the logical [L, B, H, N, C] in the member's physical
    order (outermost first), each layer its [B, H, N, C] view. tests/unit/test_kv_cache_layouts.py
    checks this rule against vLLM's ``create_kv_cache_views`` where vLLM imports."""
    order = L.VLLM_LAYOUTS[spec.vram.vllm_layout]
    logical = (spec.layers, spec.num_blocks, spec.kv_heads, spec.block_size, spec.content)
    physical = torch.empty(tuple(logical[d] for d in order), dtype=spec.dtype, device=device)
    views = physical.permute(tuple(order.index(d) for d in range(5)))  # back to [L, B, H, N, C]
    return {name: views[i] for i, name in enumerate(layer_names(spec))}


def make_kv(spec: KVSpec, device: str, seed: int) -> dict[str, torch.Tensor]:
    """The layers' tensors as vLLM allocates them (one allocation per layer, or views of one),
    each allocation filled with seeded random bytes."""
    if spec.vram.vllm_layout is not None:
        out = _vllm_views(spec, device)
    else:
        out = {name: torch.empty(spec.shape(), dtype=spec.dtype, device=device) for name in layer_names(spec)}
    filled: set[int] = set()
    for t in out.values():
        ptr = t.untyped_storage().data_ptr()
        if ptr in filled:
            continue
        # Seeded by allocation in layer order: the holder and the reader's rebuild of its bytes agree.
        g = torch.Generator(device=device).manual_seed(seed * 1009 + len(filled))
        filled.add(ptr)
        flat = flat_bytes(t)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g, device=device))
    return out


def describe(spec: KVSpec, kv: dict[str, torch.Tensor]) -> L.KVLayout:
    if spec.vram.vllm_layout is not None:
        return L.describe_kv_caches(kv, description=spec.description())
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
