"""KV cache layouts: what vLLM's KV tensors look like as registered memory.

A vLLM KV cache is described as *regions* (distinct registered allocations; layer tensors that
are views of one allocation share a region) and *segments* (one per layer, or two per layer
when K and V live apart): block ``b`` of a segment is the byte range
``[base + b*block_stride, base + b*block_stride + block_bytes)`` of its region. Blocks are
opaque bytes: the order of tokens inside a block is never assumed (on CPU, K is transposed).

Which blocks hold which tokens, and how bytes move between two layouts, is
:mod:`pdxfer.planning.peer_plan` (byte for byte) and :mod:`pdxfer.planning.convert` (another block size, format or TP
head split). :meth:`KVLayout.fingerprint` identifies a byte format (equal fingerprints: blocks are
interchangeable); :func:`content_fingerprint` identifies the KV content (dtype, layers, total KV
heads, head_dim) whatever the format, block size and TP split, i.e. what a converting reader can use.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

# Formats. The names are part of the layout fingerprint: change them only with the wire version.
CPU = "cpu"  # per layer [num_blocks, kv_heads, block_size, 2*head_dim] (vLLM CPU backend)
# The same tensor shape on hosts where vLLM's CPU attention packs blocks for AMX tiles: not byte
# compatible with CPU blocks, so it must never share a fingerprint with them.
CPU_AMX = "cpu_amx"
FLASH_NHD = "flash_nhd"  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
FLASH_HND = "flash_hnd"  # per layer [2, num_blocks, kv_heads, block_size, head_dim]
BLOCKS_FIRST_NHD = "blocks_first_nhd"  # per layer [num_blocks, 2, block_size, kv_heads, head_dim]
# vLLM's per-layer [B, H, N, C] views (one KVCacheLayout permutation for the whole cache), named by
# what one segment's block holds; C is K then V of one token and head (standard attention) or one
# latent (MLA). Whether layers or blocks are outermost does not change a block's bytes, only the
# segments' block stride, so it is not part of the name.
KV_HNC = "kv_hnc"  # per layer, block [H, N, K|V] (LBHNC, BLHNC; any layout with one head)
KV_NHC = "kv_nhc"  # per layer, block [N, H, K|V] (LBNHC, BLNHC)
# LHBNC and BHLNC put the heads outside a layer's block: a layer's block is H separate ranges,
# so each (layer, head) is a segment of its own, block [N, K|V].
KV_HEAD_NC = "kv_head_nc"
MLA_NC = "mla_nc"  # per layer, block [N, latent]: one latent per token, no K/V split, no heads
VIEW_FORMATS = (KV_HNC, KV_NHC, KV_HEAD_NC, MLA_NC)
FORMATS = (CPU, CPU_AMX, FLASH_NHD, FLASH_HND, BLOCKS_FIRST_NHD) + VIEW_FORMATS

# Kinds of KV a backend stores.
ATTENTION = "attention"  # K and V per token and head
MLA = "mla"  # one compressed latent (kv_lora_rank + rope dims) per token, shared by every head
KINDS = (ATTENTION, MLA)

# vLLM's KVCacheLayout members as stride permutations of the logical [L, B, H, N, C] axes, outermost
# physical axis first (vllm/v1/kv_cache_layout.py; a test checks these against vLLM's enum).
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
_L, _B, _H, _N, _C = range(5)

LAYOUT_WIRE_VERSION = 1


class LayoutError(ValueError):
    """A KV cache, block map or plan request that pdxfer cannot describe or serve."""


@dataclass(frozen=True)
class Region:
    """One registered allocation. ``ptr`` is a local address and never crosses a process."""

    index: int
    nbytes: int
    device: str = "cpu"
    ptr: int = 0


@dataclass(frozen=True)
class Segment:
    layer: str
    part: str  # "kv" when K and V share the block, "k" or "v" when apart, "latent" for MLA
    region: int
    base: int
    block_stride: int
    block_bytes: int
    head: int = -1  # -1: every head of the layer; else the one head this segment holds (kv_head_nc)

    def block_offset(self, block: int) -> int:
        return self.base + block * self.block_stride


@dataclass(frozen=True)
class KVLayout:
    kv_format: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    regions: tuple[Region, ...]
    segments: tuple[Segment, ...]

    @property
    def num_layers(self) -> int:
        return len({s.layer for s in self.segments})

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for, summed over every layer (and K and V)."""
        return sum(s.block_bytes for s in self.segments)

    def fingerprint(self) -> str:
        """Identity of the byte format: equal fingerprints mean a block's bytes are interchangeable.

        Excludes block count, block size and addresses (those may differ between holders).
        """
        doc = {
            "v": LAYOUT_WIRE_VERSION,
            "format": self.kv_format,
            "dtype": self.dtype,
            "layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "parts": sorted({s.part for s in self.segments}),
        }
        if self.kv_format in VIEW_FORMATS:  # (earlier formats keep their fingerprints)
            doc["kind"] = self.kind
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return f"{self.kv_format}-{self.dtype}-{hashlib.sha256(blob).hexdigest()[:16]}"

    def content_fingerprint(self, total_kv_heads: int, groups: str = "") -> str:
        """Identity of the KV *content* this cache holds, whatever its format, block size and TP
        split (see :func:`content_fingerprint`); ``kv_heads`` is this rank's share of
        ``total_kv_heads``; ``groups``: a hybrid model's KV cache groups (its segments are then
        layer slots, each holding one layer of every group)."""
        if total_kv_heads < self.kv_heads or (total_kv_heads % self.kv_heads and self.kv_heads != 1):
            raise LayoutError(f"{self.kv_heads} KV heads per rank cannot be a TP share of {total_kv_heads} "
                              "KV heads in all")
        return content_fingerprint(self.dtype, self.num_layers, total_kv_heads, self.head_dim, self.kind, groups)

    @property
    def kind(self) -> str:
        return MLA if self.kv_format == MLA_NC else ATTENTION

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able description (no local addresses) that a peer can plan against."""
        return {
            "v": LAYOUT_WIRE_VERSION,
            "kv_format": self.kv_format,
            "dtype": self.dtype,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "regions": [{"index": r.index, "nbytes": r.nbytes, "device": r.device} for r in self.regions],
            "segments": [asdict(s) for s in self.segments],
        }

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> "KVLayout":
        try:
            if doc["v"] != LAYOUT_WIRE_VERSION:
                raise LayoutError(f"layout wire version {doc['v']} is not {LAYOUT_WIRE_VERSION}")
            layout = cls(
                kv_format=str(doc["kv_format"]),
                dtype=str(doc["dtype"]),
                num_blocks=int(doc["num_blocks"]),
                block_size=int(doc["block_size"]),
                kv_heads=int(doc["kv_heads"]),
                head_dim=int(doc["head_dim"]),
                regions=tuple(Region(int(r["index"]), int(r["nbytes"]), str(r["device"])) for r in doc["regions"]),
                segments=tuple(Segment(**s) for s in doc["segments"]),
            )
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"malformed layout description: {exc!r}") from exc
        layout.validate()
        return layout

    def validate(self) -> None:
        if self.kv_format not in FORMATS:
            raise LayoutError(f"unknown KV format {self.kv_format!r}; known: {', '.join(FORMATS)}")
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise LayoutError(f"num_blocks and block_size must be positive, got {self.num_blocks}, {self.block_size}")
        for i, r in enumerate(self.regions):
            if r.index != i:
                raise LayoutError(f"region {i} carries index {r.index}")
        for s in self.segments:
            if not 0 <= s.region < len(self.regions):
                raise LayoutError(f"segment {s.layer}/{s.part} names region {s.region}, have {len(self.regions)}")
            last_end = s.block_offset(self.num_blocks - 1) + s.block_bytes
            if s.base < 0 or s.block_bytes <= 0 or last_end > self.regions[s.region].nbytes:
                raise LayoutError(f"segment {s.layer}/{s.part} runs outside region {s.region}")

    def check_blocks(self, blocks: Iterable[int], side: str = "") -> None:
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise LayoutError(f"{side + ' ' if side else ''}block id {b!r} outside [0, {self.num_blocks})")


def content_fingerprint(dtype: str, num_layers: int, total_kv_heads: int, head_dim: int,
                        kind: str = ATTENTION, groups: str = "") -> str:
    """Identity of KV content independent of the byte format, block size and TP split.

    Two caches with equal content fingerprints hold the same numbers for the same tokens (given the
    same model), so :mod:`pdxfer.planning.convert` can move KV between them; keys may be namespaced by this
    instead of :meth:`KVLayout.fingerprint` once readers convert. The dtype stays in: converting
    it would change the numbers. For fp8 caches it is the exact variant (``float8_e4m3fn``,
    ``float8_e5m2``), never the ``uint8`` vLLM stores them as. ``kind``: an MLA latent is other
    numbers than K and V of the same sizes (``total_kv_heads`` is 1 for MLA: every rank holds it whole).
    ``groups``: a hybrid model's KV cache groups (:meth:`pdxfer.kv.groups.KVGroups.signature`),
    which decide what a chunk's location holds; empty for one full-attention group.
    """
    if kind not in KINDS:
        raise LayoutError(f"content_fingerprint: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    for name, v in (("num_layers", num_layers), ("total_kv_heads", total_kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise LayoutError(f"content_fingerprint: {name} must be a positive int, got {v!r}")
    doc = {"v": LAYOUT_WIRE_VERSION, "what": "kv-content", "dtype": str(dtype), "layers": num_layers,
           "total_kv_heads": total_kv_heads, "head_dim": head_dim}
    if kind != ATTENTION:
        doc["kind"] = kind
    if groups:
        doc["groups"] = groups
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return f"kv-{dtype}-{hashlib.sha256(blob).hexdigest()[:16]}"


# --------------------------------------------------------------------------- describing tensors

_FORMAT_SHAPES = {
    # format -> (rank, index of num_blocks, index of block_size, index of kv_heads, K/V split dim or None)
    CPU: (4, 0, 2, 1, None),
    CPU_AMX: (4, 0, 2, 1, None),
    FLASH_NHD: (5, 1, 2, 3, 0),
    FLASH_HND: (5, 1, 3, 2, 0),
    BLOCKS_FIRST_NHD: (5, 0, 2, 3, 1),
}


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


# Element types a uint8 KV tensor may stand for (vLLM's fp8 caches; names as torch spells them).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def _checked_dtype(tensor_dtype: str, named: str | None) -> str:
    if named is None or named == tensor_dtype:
        return tensor_dtype
    if tensor_dtype == "uint8" and named in FP8_DTYPES:
        return named
    raise LayoutError(f"KV tensors of dtype {tensor_dtype} cannot hold {named} values (a uint8 cache may be "
                      f"named one of {', '.join(FP8_DTYPES)})")


def _candidate_formats(shape: tuple[int, ...], block_size: int | None) -> list[str]:
    out = []
    for fmt, (rank, nb_dim, bs_dim, _h, kv_dim) in _FORMAT_SHAPES.items():
        if fmt == CPU_AMX:
            continue  # the shape of CPU: only the caller (who knows the ISA) can name it
        if len(shape) != rank or (kv_dim is not None and shape[kv_dim] != 2):
            continue
        if block_size is not None and shape[bs_dim] != block_size:
            continue
        out.append(fmt)
    return out


def detect_format(shape: Sequence[int], block_size: int | None = None) -> str:
    """Name the KV format of one layer tensor's shape; ``block_size`` breaks NHD/HND ties."""
    shape = tuple(int(x) for x in shape)
    cands = _candidate_formats(shape, block_size)
    if not cands:
        raise LayoutError(f"KV tensor shape {shape} matches no known format "
                          f"(block_size={block_size}); known: {', '.join(FORMATS)}")
    if len(cands) > 1:
        raise LayoutError(f"KV tensor shape {shape} is ambiguous between {cands}; pass block_size "
                          "or kv_format explicitly")
    return cands[0]


def _inner_contiguous(t: Any, from_dim: int) -> bool:
    expected = 1
    for d in range(t.dim() - 1, from_dim - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _region_of(t: Any, regions: list[Region], region_of_storage: dict[int, int]) -> tuple[int, int]:
    """(region index, byte offset in it) of tensor ``t``; layer tensors viewing one allocation
    share a region, added to ``regions`` the first time its storage is met."""
    storage = t.untyped_storage()
    sptr = storage.data_ptr()
    if sptr not in region_of_storage:
        region_of_storage[sptr] = len(regions)
        regions.append(Region(len(regions), storage.nbytes(), str(t.device), sptr))
    return region_of_storage[sptr], t.data_ptr() - sptr


def describe_kv_caches(
    kv_caches: Mapping[str, Any], block_size: int | None = None, kv_format: str | None = None,
    dtype: str | None = None, description: KVDescription | None = None,
) -> KVLayout:
    """Describe the ``{layer_name: tensor}`` dict vLLM hands to ``register_kv_caches``.

    Tensors that are views of one allocation become one region. Layers are ordered by name so
    both sides of a transfer enumerate segments identically. ``dtype`` names the element type
    when the tensor's cannot: vLLM stores every fp8 variant as ``uint8``, and an e4m3 block read
    as e5m2 is other numbers, so the layout (and its fingerprints) must carry the variant.

    ``description`` (what the backend and vLLM's resolved layout say) describes vLLM's
    ``[B, H, N, C]`` views exactly (:func:`describe_vllm_views`); so does a ``kv_format`` among
    :data:`VIEW_FORMATS` with ``block_size`` (:func:`view_description` reads the permutation from
    the strides). Otherwise the format is named or detected from the shape.
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors given")
    if description is not None:
        if kv_format is not None and kv_format != description.kv_format:
            raise LayoutError(f"format {kv_format} named, but {description} is format {description.kv_format}")
        return describe_vllm_views(kv_caches, description)
    if kv_format in VIEW_FORMATS:
        if block_size is None:
            raise LayoutError(f"describing {kv_format} views needs the block size")
        return describe_vllm_views(kv_caches, view_description(kv_caches, kv_format, block_size, dtype))
    names = sorted(kv_caches)
    first = kv_caches[names[0]]
    dtype = _checked_dtype(_dtype_name(first), dtype)
    fmt = kv_format or detect_format(tuple(first.shape), block_size)
    if fmt not in _FORMAT_SHAPES:
        raise LayoutError(f"unknown KV format {fmt!r}; known: {', '.join(FORMATS)}")
    rank, nb_dim, bs_dim, h_dim, kv_dim = _FORMAT_SHAPES[fmt]

    regions: list[Region] = []
    region_of_storage: dict[int, int] = {}
    segments: list[Segment] = []
    ref_shape = tuple(first.shape)
    seen_views: set[tuple[int, int, int]] = set()
    for name in names:
        t = kv_caches[name]
        if not hasattr(t, "untyped_storage"):
            raise LayoutError(f"layer {name}: expected a torch tensor, got {type(t).__name__}")
        if tuple(t.shape) != ref_shape or t.dtype != first.dtype:
            raise LayoutError(f"layer {name}: shape {tuple(t.shape)} {t.dtype} differs from "
                              f"{names[0]}: {ref_shape} {first.dtype}")
        if t.dim() != rank or (kv_dim is not None and t.shape[kv_dim] != 2):
            raise LayoutError(f"layer {name}: shape {tuple(t.shape)} is not format {fmt}")
        ridx, base = _region_of(t, regions, region_of_storage)
        esize = t.element_size()
        block_stride = t.stride(nb_dim) * esize
        if not _first_view(seen_views, ridx, base, block_stride):
            continue
        # The per-block byte range must be contiguous in memory, whatever order lies inside it.
        if not _inner_contiguous(t, nb_dim + 1):
            raise LayoutError(f"layer {name}: a block is not one contiguous byte range (strides {t.stride()})")
        if kv_dim is None or kv_dim > nb_dim:
            block_bytes = esize
            for d in range(nb_dim + 1, rank):
                block_bytes *= t.shape[d]
            segments.append(Segment(name, "kv", ridx, base, block_stride, block_bytes))
        else:
            block_bytes = esize
            for d in range(nb_dim + 1, rank):
                block_bytes *= t.shape[d]
            for part, i in (("k", 0), ("v", 1)):
                segments.append(Segment(name, part, ridx, base + i * t.stride(kv_dim) * esize,
                                        block_stride, block_bytes))

    head_dim = ref_shape[-1] // 2 if fmt in (CPU, CPU_AMX) else ref_shape[-1]
    layout = KVLayout(fmt, dtype, ref_shape[nb_dim], ref_shape[bs_dim], ref_shape[h_dim],
                      head_dim, tuple(regions), tuple(segments))
    layout.validate()
    return layout


# --------------------------------------------------------------------------- vLLM's [B, H, N, C] views

@dataclass(frozen=True)
class KVDescription:
    """What a vLLM KV cache holds, as the attention backend and vLLM's resolved layout say
    (not guessed from tensor shapes): ``kind`` (:data:`ATTENTION` or :data:`MLA`), ``vllm_layout``
    (a KVCacheLayout member name), tokens per block, KV heads of this rank (1 for MLA), head dim
    (of K and of V; the latent's for MLA) and the exact element dtype."""

    kind: str
    vllm_layout: str
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"KV kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.vllm_layout not in VLLM_LAYOUTS:
            raise LayoutError(f"unknown vLLM KV cache layout {self.vllm_layout!r}; known: {', '.join(VLLM_LAYOUTS)}")
        for name in ("block_size", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise LayoutError(f"KVDescription.{name} must be a positive int, got {v!r}")
        if self.kind == MLA and self.kv_heads != 1:
            raise LayoutError(f"an MLA cache holds one latent per token, not {self.kv_heads} heads")

    @property
    def kv_format(self) -> str:
        """The pdxfer format of these blocks. With one head, heads inside or outside a block make
        no difference to its bytes, so every layout is ``kv_hnc`` (interchangeable blocks, one
        fingerprint)."""
        if self.kind == MLA:
            return MLA_NC
        order = VLLM_LAYOUTS[self.vllm_layout]
        if self.kv_heads == 1 or order[-3:] == (_H, _N, _C):
            return KV_HNC
        if order[-3:] == (_N, _H, _C):
            return KV_NHC
        return KV_HEAD_NC

    @property
    def content(self) -> int:
        """Elements of C, one token of one head (K then V, or the latent)."""
        return self.head_dim if self.kind == MLA else 2 * self.head_dim


def _expected_view_order(layout_name: str) -> tuple[int, ...]:
    """Physical order (outermost first) of the [B, H, N, C] dims of one layer's view."""
    return tuple(d - 1 for d in VLLM_LAYOUTS[layout_name] if d != _L)


def _check_view_strides(name: str, t: Any, desc: KVDescription) -> None:
    """The tensor's strides must order its dims as ``desc.vllm_layout`` says (size-1 dims aside)."""
    order = [d for d in _expected_view_order(desc.vllm_layout) if t.shape[d] > 1]
    strides = [t.stride(d) for d in order]
    if t.shape[3] > 1 and t.stride(3) != 1 or any(a < b for a, b in zip(strides, strides[1:])):
        raise LayoutError(f"layer {name}: strides {tuple(t.stride())} of shape {tuple(t.shape)} are not the "
                          f"{desc.vllm_layout} layout the description names")


def _dense(t: Any, dims: Sequence[int]) -> bool:
    """Dims ``dims`` (outermost first) of ``t`` form one dense row-major range."""
    expected = 1
    for d in reversed(dims):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _first_view(seen: set[tuple[int, int, int]], region: int, base: int, block_stride: int) -> bool:
    """Whether a layer's view is the first at this place. With vLLM's hybrid KV cache manager
    one layer of every KV cache group shares a tensor (each block belongs to one group at a
    time): one segment then covers them all, named by the first of them in name order."""
    key = (region, base, block_stride)
    if key in seen:
        return False
    seen.add(key)
    return True


def describe_vllm_views(kv_caches: Mapping[str, Any], desc: KVDescription) -> KVLayout:
    """Describe vLLM's per-layer ``[B, H, N, C]`` views (any KVCacheLayout, layer- or
    block-outermost, layers in one allocation or several) from an explicit description.

    Every segment's block is one contiguous byte range: a layer's block where the layout keeps
    ``[H, N, C]`` or ``[N, H, C]`` together, else (LHBNC, BHLNC: heads outside blocks) one
    segment per (layer, head). Block-outermost layouts give segments the cross-layer block as
    block stride, so one block of every layer is adjacent. Refuses, naming the layer and why,
    tensors that do not match the description.
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors given")
    fmt = desc.kv_format
    names = sorted(kv_caches)
    regions: list[Region] = []
    region_of_storage: dict[int, int] = {}
    segments: list[Segment] = []
    want_shape_tail = (desc.kv_heads, desc.block_size, desc.content)
    num_blocks = None
    seen_views: set[tuple[int, int, int]] = set()
    for name in names:
        t = kv_caches[name]
        if not hasattr(t, "untyped_storage"):
            raise LayoutError(f"layer {name}: expected a torch tensor, got {type(t).__name__}")
        _checked_dtype(_dtype_name(t), desc.dtype)
        if t.dim() != 4 or tuple(t.shape[1:]) != want_shape_tail:
            raise LayoutError(f"layer {name}: shape {tuple(t.shape)} is not vLLM's [blocks, heads, block_size, "
                              f"content] view for {desc} (expected [*, {', '.join(map(str, want_shape_tail))}]); "
                              "a block split into smaller kernel blocks is not supported")
        if num_blocks is None:
            num_blocks = int(t.shape[0])
        elif t.shape[0] != num_blocks:
            raise LayoutError(f"layer {name}: {t.shape[0]} blocks, {names[0]} has {num_blocks}")
        _check_view_strides(name, t, desc)
        ridx, base = _region_of(t, regions, region_of_storage)
        esize = t.element_size()
        block_stride = t.stride(0) * esize
        if not _first_view(seen_views, ridx, base, block_stride):
            continue
        part = "latent" if desc.kind == MLA else "kv"
        if fmt == KV_HEAD_NC:
            if not _dense(t, (2, 3)):
                raise LayoutError(f"layer {name}: one head's block [N, C] is not one contiguous byte range "
                                  f"(strides {tuple(t.stride())})")
            nbytes = desc.block_size * desc.content * esize
            segments.extend(Segment(name, part, ridx, base + h * t.stride(1) * esize, block_stride, nbytes, h)
                            for h in range(desc.kv_heads))
            continue
        inner = (2, 1, 3) if fmt == KV_NHC else (1, 2, 3)
        if not _dense(t, inner):
            raise LayoutError(f"layer {name}: a block is not one contiguous byte range under {desc.vllm_layout} "
                              f"(strides {tuple(t.stride())})")
        nbytes = desc.kv_heads * desc.block_size * desc.content * esize
        segments.append(Segment(name, part, ridx, base, block_stride, nbytes))
    assert num_blocks is not None
    layout = KVLayout(fmt, desc.dtype, num_blocks, desc.block_size, desc.kv_heads, desc.head_dim,
                      tuple(regions), tuple(segments))
    layout.validate()
    return layout


def view_description(kv_caches: Mapping[str, Any], kv_format: str, block_size: int, dtype: str | None = None,
                     ) -> KVDescription:
    """The description of vLLM ``[B, H, N, C]`` views in ``kv_format`` (one of
    :data:`VIEW_FORMATS`) whose layout permutation is read from the tensors' strides, for a
    caller that knows the format but not vLLM's layout name. The heads and head dim come from
    the view's H and C, which vLLM's allocation fixes. Layer- and block-outermost variants of a
    layout give one description here (their blocks hold the same bytes): the segments' block
    strides are read from the tensors by :func:`describe_vllm_views`."""
    if kv_format not in VIEW_FORMATS:
        raise LayoutError(f"{kv_format!r} is not one of vLLM's view formats ({', '.join(VIEW_FORMATS)})")
    first = kv_caches[sorted(kv_caches)[0]]
    if first.dim() != 4:
        raise LayoutError(f"a {kv_format} KV tensor is a 4-dim [B, H, N, C] view, got shape {tuple(first.shape)}")
    _, heads, _, content = (int(x) for x in first.shape)
    kind = MLA if kv_format == MLA_NC else ATTENTION
    if kind == ATTENTION and content % 2:
        raise LayoutError(f"an attention view's C holds K then V, so it is even; got shape {tuple(first.shape)}")
    head_dim = content if kind == MLA else content // 2
    dtype = _checked_dtype(_dtype_name(first), dtype)
    for name in VLLM_LAYOUTS:
        desc = KVDescription(kind, name, block_size, heads, head_dim, dtype) if kind == ATTENTION or heads == 1 \
            else None
        if desc is None or desc.kv_format != kv_format:
            continue
        try:
            for lname in sorted(kv_caches):
                _check_view_strides(lname, kv_caches[lname], desc)
        except LayoutError:
            continue
        return desc
    raise LayoutError(f"KV views of shape {tuple(first.shape)}, strides {tuple(first.stride())} are in no vLLM "
                      f"layout whose blocks are format {kv_format}")
