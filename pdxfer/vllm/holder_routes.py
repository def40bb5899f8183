"""How one reader rank reads a holder engine's chunks: from which holder rank, which heads, and
whether the bytes go straight into place or through staging and conversion.

Keys name KV content, not its layout (namespace v2, :mod:`pdxfer.kv.keys`): a chunk found at the
master may sit on a holder of another TP size, byte format or block size. The scheduler asks
this module, once per holder, whether *every* reader rank can read it (a chunk is only usable
when all ranks can load their heads; vLLM waits for all of them); each worker asks it again for
its own rank, with its real tensors' layout, to plan.

Per holder rank a reader rank reads from (:func:`pdxfer.kv.heads.head_sources`):

- **direct**: the bytes need no rearranging, so they are READ straight into the reader's blocks
  (:class:`pdxfer.planning.peer_plan.PeerPlanner`): same byte format and block size with all heads, or a head
  slice between head-major blocks (cpu, flash_hnd) of equal size, where a head is one byte range;
- **converted**: anything else that :func:`pdxfer.planning.convert.check_convertible` accepts (another
  format, block size, or a slice of the holder rank's heads), READ into the registered staging
  area and scattered (:class:`pdxfer.planning.convert.ConvertingPlanner`); needs ``staging_mib`` > 0;
- **not readable**: AMX-packed blocks on either side (unless byte-identical), a dtype mismatch,
  another total of KV heads, anything conversion refuses. :class:`NotReadable` names both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pdxfer.planning.convert import check_convertible
from pdxfer.kv.heads import head_sources
from pdxfer.kv.layout import CPU_AMX, KVLayout, LayoutError
from pdxfer.planning.peer_plan import PeerPlanner


class NotReadable(ValueError):
    """This reader cannot use a holder's blocks; the message names both sides."""


@dataclass(frozen=True)
class Route:
    """Read ``nheads`` heads starting at ``src_head`` of ``holder_rank``'s blocks into heads from
    ``dst_head`` of this reader rank's blocks; ``direct``: byte-identical, block for block."""

    holder_rank: int
    src_head: int
    dst_head: int
    nheads: int
    direct: bool


def routes(node_id: str, holder_layouts: Sequence[KVLayout], holder_total_heads: int, local: KVLayout,
           reader_tp: int, reader_rank: int, reader_total_heads: int, *, staging: bool,
           chunk_tokens: int) -> list[Route]:
    """The reads reader rank ``reader_rank`` makes from holder ``node_id`` (ranks' layouts in
    rank order); raises :class:`NotReadable` naming both sides."""
    side = f"holder {node_id}"
    if holder_total_heads != reader_total_heads:
        raise NotReadable(f"{side} has {holder_total_heads} KV heads in all, this reader "
                          f"{reader_total_heads}: not the same model")
    try:
        sources = head_sources(reader_total_heads, len(holder_layouts), reader_tp, reader_rank)
    except ValueError as exc:
        raise NotReadable(f"{side} (TP {len(holder_layouts)}) and this reader (TP {reader_tp}, rank "
                          f"{reader_rank}): {exc}") from exc
    out = []
    for src in sources:
        remote = holder_layouts[src.holder_rank]
        where = f"{side} rank {src.holder_rank}"
        if remote.dtype != local.dtype:
            raise NotReadable(f"{where} holds KV as {remote.dtype}, this reader as {local.dtype}: converting "
                              "would change the numbers")
        if _direct(remote, local, src.src_head, src.dst_head, src.nheads):
            out.append(Route(src.holder_rank, src.src_head, src.dst_head, src.nheads, True))
            continue
        if CPU_AMX in (remote.kv_format, local.kv_format):
            raise NotReadable(f"{where} writes {remote.kv_format} blocks (block size {remote.block_size}, "
                              f"{remote.kv_heads} heads), this reader {local.kv_format} (block size "
                              f"{local.block_size}, {local.kv_heads} heads): AMX-packed blocks are only "
                              "read byte for byte")
        try:
            check_convertible(remote, local)
        except LayoutError as exc:
            raise NotReadable(f"{where} cannot be converted for this reader: {exc}") from exc
        hb = remote.block_size
        if hb != local.block_size and not (chunk_tokens % hb == 0 or hb % chunk_tokens == 0):
            raise NotReadable(f"{where} has block size {hb}, which neither divides nor is a multiple of "
                              f"chunk_tokens {chunk_tokens}")
        if not staging:
            raise NotReadable(f"{where} ({remote.kv_format}, block size {hb}, heads {src.src_head}+"
                              f"{src.nheads}) needs conversion into this reader's {local.kv_format} blocks "
                              f"(block size {local.block_size}), and staging_mib is 0")
        out.append(Route(src.holder_rank, src.src_head, src.dst_head, src.nheads, False))
    return out


def _direct(remote: KVLayout, local: KVLayout, src_head: int, dst_head: int, nheads: int) -> bool:
    """Whether PeerPlanner moves these heads straight into place (its own check is the rule; made
    once per holder, so trying costs nothing on the read path)."""
    try:
        PeerPlanner(remote, local, src_head=src_head, dst_head=dst_head, nheads=nheads)
    except LayoutError:
        return False
    return True


def holder_total_heads(total_kv_heads: int, tp_size: int, rank0_layout: KVLayout) -> int:
    """A holder's total KV heads as announced; holders that did not say (0): rank 0's share x TP
    (exact unless heads are replicated, which only happens with TP larger than the head count)."""
    return total_kv_heads or rank0_layout.kv_heads * tp_size


def layouts_of(endpoints: Sequence[Any]) -> list[KVLayout]:
    """Rank-ordered layouts of a holder's endpoints (anything with ``rank`` and wire ``layout``)."""
    eps = sorted(endpoints, key=lambda e: e.rank)
    if [e.rank for e in eps] != list(range(len(eps))):
        raise NotReadable(f"holder endpoints are ranks {[e.rank for e in eps]}, not 0..{len(eps) - 1}")
    try:
        return [KVLayout.from_wire(e.layout) for e in eps]
    except LayoutError as exc:
        raise NotReadable(f"holder layout does not parse: {exc}") from exc


def holder_route_key(holder: Any, endpoint_part: Callable[[Any], object]) -> tuple[str, str]:
    """The key under which what was decided about ``holder`` (a lookup's node or a
    :class:`~pdxfer.vllm.metadata.HolderRef`) is kept: its node id, and its total KV heads with,
    per endpoint, the rank, ``endpoint_part(endpoint)`` and the block size. A holder that
    registers again with another layout or transport address gets a new key, so nothing
    decided about its previous registration is reused."""
    # repr: one hashable text of the announcement whatever types its wire values have (a
    # layout value decoded from JSON may be a list).
    sig = repr([(e.rank, endpoint_part(e), e.layout.get("block_size")) for e in holder.endpoints])
    return (holder.node_id, f"{holder.total_kv_heads}:{sig}")


__all__ = ["NotReadable", "Route", "check_convertible", "holder_route_key", "holder_total_heads", "layouts_of",
           "routes"]
