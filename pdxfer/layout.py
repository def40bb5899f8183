"""KV cache layouts: what vLLM's KV tensors look like as registered memory.

A vLLM KV cache is described as *regions* (distinct registered allocations; layer tensors that
are views of one allocation share a region) and *segments* (one per layer, or two per layer
when K and V live apart): block ``b`` of a segment is the byte range
``[base + b*block_stride, base + b*block_stride + block_bytes)`` of its region. Blocks are
opaque bytes: the order of tokens inside a block is never assumed (on CPU, K is transposed).

Which blocks hold which tokens, and how bytes move between two layouts, is
:mod:`pdxfer.plan` (byte for byte) and :mod:`pdxfer.convert` (another block size, format or TP
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
FORMATS = (CPU, CPU_AMX, FLASH_NHD, FLASH_HND, BLOCKS_FIRST_NHD)

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
    part: str  # "kv" when K and V share the block, else "k" or "v"
    region: int
    base: int
    block_stride: int
    block_bytes: int

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
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return f"{self.kv_format}-{self.dtype}-{hashlib.sha256(blob).hexdigest()[:16]}"

    def content_fingerprint(self, total_kv_heads: int) -> str:
        """Identity of the KV *content* this cache holds, whatever its format, block size and TP
        split (see :func:`content_fingerprint`); ``kv_heads`` is this rank's share of
        ``total_kv_heads``."""
        if total_kv_heads < self.kv_heads or (total_kv_heads % self.kv_heads and self.kv_heads != 1):
            raise LayoutError(f"{self.kv_heads} KV heads per rank cannot be a TP share of {total_kv_heads} "
                              "KV heads in all")
        return content_fingerprint(self.dtype, self.num_layers, total_kv_heads, self.head_dim)

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


def content_fingerprint(dtype: str, num_layers: int, total_kv_heads: int, head_dim: int) -> str:
    """Identity of KV content independent of the byte format, block size and TP split.

    Two caches with equal content fingerprints hold the same numbers for the same tokens (given the
    same model), so :mod:`pdxfer.convert` can move KV between them; keys may be namespaced by this
    instead of :meth:`KVLayout.fingerprint` once readers convert. The dtype stays in: converting
    it would change the numbers. For fp8 caches it is the exact variant (``float8_e4m3fn``,
    ``float8_e5m2``), never the ``uint8`` vLLM stores them as.
    """
    for name, v in (("num_layers", num_layers), ("total_kv_heads", total_kv_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise LayoutError(f"content_fingerprint: {name} must be a positive int, got {v!r}")
    doc = {"v": LAYOUT_WIRE_VERSION, "what": "kv-content", "dtype": str(dtype), "layers": num_layers,
           "total_kv_heads": total_kv_heads, "head_dim": head_dim}
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


def describe_kv_caches(
    kv_caches: Mapping[str, Any], block_size: int | None = None, kv_format: str | None = None,
    dtype: str | None = None,
) -> KVLayout:
    """Describe the ``{layer_name: tensor}`` dict vLLM hands to ``register_kv_caches``.

    Tensors that are views of one allocation become one region. Layers are ordered by name so
    both sides of a transfer enumerate segments identically. ``dtype`` names the element type
    when the tensor's cannot: vLLM stores every fp8 variant as ``uint8``, and an e4m3 block read
    as e5m2 is other numbers, so the layout (and its fingerprints) must carry the variant.
    """
    if not kv_caches:
        raise LayoutError("no KV cache tensors given")
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
    for name in names:
        t = kv_caches[name]
        if not hasattr(t, "untyped_storage"):
            raise LayoutError(f"layer {name}: expected a torch tensor, got {type(t).__name__}")
        if tuple(t.shape) != ref_shape or t.dtype != first.dtype:
            raise LayoutError(f"layer {name}: shape {tuple(t.shape)} {t.dtype} differs from "
                              f"{names[0]}: {ref_shape} {first.dtype}")
        if t.dim() != rank or (kv_dim is not None and t.shape[kv_dim] != 2):
            raise LayoutError(f"layer {name}: shape {tuple(t.shape)} is not format {fmt}")
        storage = t.untyped_storage()
        sptr = storage.data_ptr()
        if sptr not in region_of_storage:
            region_of_storage[sptr] = len(regions)
            regions.append(Region(len(regions), storage.nbytes(), str(t.device), sptr))
        ridx = region_of_storage[sptr]
        esize = t.element_size()
        base = t.data_ptr() - sptr
        block_stride = t.stride(nb_dim) * esize
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
