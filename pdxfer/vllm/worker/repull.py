"""Re-pull: a load whose read failed (holder dead, frozen past its bound, connection refused) or
whose lock the master refused is looked up again, excluding the holders that failed it, and read
from another holder, before vLLM recomputes anything.

Each worker (TP rank) re-pulls its own heads under its own lock (one party). What it re-reads is
every token from the first one a failed or unfinished read could have written: positions before
it were written only by reads that finished under a lock the master confirmed, positions from it
on are all rewritten under the new lock, and a block the new holders cannot fill is reported as a
load error (vLLM recomputes from the first of those). So no block ends up with bytes of a holder
that was not valid, whatever mix of holders served it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from pdxfer.vllm.load_plan import HitShape, exact_end, first_written, plan_reads
from pdxfer.vllm.metadata import HolderRef, NodeRead, RepullSpec


def restart_token(rp: RepullSpec, reads: Sequence[NodeRead], incomplete: Iterable[str] | None,
                  block_size: int) -> int:
    """The first token to re-pull: from the first position a read of an ``incomplete`` node may
    have written (None: every read is in doubt, the lock was refused), aligned down to a block."""
    if incomplete is None:
        return rp.start
    nodes = set(incomplete)
    firsts = [first_written(r, rp.block_ids, block_size) for r in reads if r.node_id in nodes]
    t0 = min(firsts) if firsts else rp.start
    return max(rp.start, t0 // block_size * block_size)


def lookup_keys(rp: RepullSpec, t0: int) -> list[bytes]:
    """The hit's keys from the chunk holding token ``t0`` on."""
    return list(rp.keys[t0 // rp.chunk_tokens - rp.first_chunk:])


def blocks_from(rp: RepullSpec, t0: int, block_size: int) -> set[int]:
    """The request's blocks holding tokens ``[t0, end)`` of this load."""
    if t0 >= rp.end:
        return set()
    return set(rp.block_ids[t0 // block_size: -(-rp.end // block_size)])


@dataclass(frozen=True)
class RepullPlan:
    """The reads of a re-pull of tokens ``[start, end)`` (``end`` may fall short of the load's:
    ``lost`` are the blocks no other holder could fill), and the spec for a later re-pull of it."""

    reads: tuple[NodeRead, ...]
    holders: tuple[HolderRef, ...]
    start: int
    end: int
    lost: set[int]
    chunks: int  # chunks the reads cover (the "repulls" stat)
    spec: RepullSpec


def plan_repull(rp: RepullSpec, t0: int, res: Any, block_size: int,
                readable: Callable[[HolderRef], bool]) -> RepullPlan:
    """Plan the re-pull of tokens ``[t0, rp.end)`` from lookup result ``res`` (its leading chunks
    on holders this rank can read; LayoutError when their blocks do not fit their chunks)."""
    C, bs = rp.chunk_tokens, block_size
    c0 = t0 // C
    keys = lookup_keys(rp, t0)
    refs: dict[str, HolderRef] = {}
    n = 0
    for loc in list(res.locations)[: res.hit_chunks]:
        node = res.nodes.get(loc.node_id)
        if node is None:
            break
        ref = refs.get(loc.node_id)
        if ref is None:
            ref = refs[loc.node_id] = HolderRef.of(node, (res.epochs or {}).get(loc.node_id, 0))
        if not readable(ref):
            break
        n += 1
    tail = rp.tail_tokens if rp.tail_tokens and n == len(keys) else 0
    full = n - (1 if tail else 0)
    cover = rp.end if n == len(keys) else min(rp.end, (c0 + full) * C)
    if cover < rp.end:
        cover -= cover % bs  # a partly covered block keeps bytes of a failed read: it is lost
    locs = tuple((loc.node_id, tuple(int(b) for b in loc.block_ids)) for loc in list(res.locations)[:n])
    shape = HitShape(c0, locs, {nid: int(ref.layout["block_size"]) for nid, ref in refs.items()}, C, tail)
    end = exact_end(shape, bs, t0, cover) if cover > t0 else t0
    reads = plan_reads(shape, bs, t0, end, rp.block_ids) if end > t0 else ()
    used = sorted({r.node_id for r in reads})
    spec = RepullSpec(rp.reader, tuple(keys[:n]), c0, tail, C, t0, end, rp.block_ids, rp.skip, rp.lock_ttl_s)
    chunks = (-(-end // C) - c0) if end > t0 else 0
    return RepullPlan(tuple(reads), tuple(refs[u] for u in used), t0, end, blocks_from(rp, end, bs), chunks, spec)
