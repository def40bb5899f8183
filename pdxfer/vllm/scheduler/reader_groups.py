"""The reader path's part for a hybrid model (several KV cache groups): which holders it reads
from, how far a hit reaches when every group must be served, and the block-for-block reads of
every group (:mod:`pdxfer.planning.group_hits`).

Hybrid loads read only from holders with the same groups, block size and TP size, block for
block (with recurrent state, also the same byte format: the state rides in the attention pages,
which a conversion would scramble); a failed read is recomputed, never re-pulled.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pdxfer.kv.groups import LAYOUT_KEY, GroupError, KVGroups
from pdxfer.planning.group_hits import GroupHit, group_block_pairs, servable_end
from pdxfer.vllm.holder_routes import NotReadable
from pdxfer.vllm.metadata import NodeRead

def check_group_holder(node: Any, groups: KVGroups, block_size: int, tp_size: int) -> None:
    """Refuse (NotReadable, naming what differs) a holder a hybrid reader cannot read."""
    theirs = KVGroups.from_wire(node.layout.get(LAYOUT_KEY))
    if theirs != groups:
        raise NotReadable(f"holder {node.node_id} has KV cache groups [{theirs.signature()}], this reader "
                          f"[{groups.signature()}]")
    holder_bs = int(node.layout.get("block_size", 0))
    if holder_bs != block_size:
        raise NotReadable(f"holder {node.node_id} has blocks of {holder_bs} tokens, this reader {block_size}: a "
                          "hybrid model's sliding windows and groups are moved only between equal block sizes")
    if int(getattr(node, "tp_size", 1) or 1) != tp_size:
        raise NotReadable(f"holder {node.node_id} runs TP {node.tp_size}, this reader TP {tp_size}: a hybrid "
                          "model's KV is moved only between equal TP sizes")


def check_state_bytes(node_id: str, holder_layouts: Sequence[Any], local: Mapping[int, Any]) -> None:
    """Refuse (NotReadable) a holder whose pages are not byte for byte this reader's: a hybrid
    model's recurrent state lies inside the attention pages and moves only as they are."""
    for rank, mine in sorted(local.items()):
        theirs = holder_layouts[rank] if rank < len(holder_layouts) else None
        if theirs is None or theirs.fingerprint() != mine.fingerprint():
            raise NotReadable(f"holder {node_id} rank {rank} lays KV out as "
                              f"{theirs.fingerprint() if theirs is not None else 'nothing'}, this reader as "
                              f"{mine.fingerprint()}; recurrent state moves only between equal layouts")


def group_hit(groups: KVGroups, locations: Sequence[Any], first_chunk: int, chunk_tokens: int,
              block_size: int, tail_tokens: int) -> GroupHit:
    return GroupHit(groups, tuple((loc.node_id, tuple(int(b) for b in loc.block_ids)) for loc in locations),
                    first_chunk, chunk_tokens, block_size, tail_tokens)


def groups_end(hit: GroupHit, local: int, end: int) -> tuple[int, int, int]:
    """(servable end, locations kept, tail tokens kept) of a hit of ``end`` tokens."""
    got, cut = servable_end(hit, local, end)
    return got, len(cut.entries), cut.tail_tokens


def plan_group_reads(hit: GroupHit, start: int, end: int, tables: Sequence[Sequence[int]], null_block: int,
                     ) -> tuple[tuple[NodeRead, ...], tuple[tuple[str, tuple[int, ...]], ...]]:
    """The reads filling tokens ``[start, end)`` of every group into the reader's per-group block
    tables, and (group kind, reader blocks filled) per group (GroupError if any group cannot be
    served)."""
    if len(tables) != len(hit.groups):
        raise GroupError(f"{len(tables)} block tables for {len(hit.groups)} KV cache groups")
    per_node: dict[str, tuple[list[int], list[int]]] = {}
    filled: list[tuple[str, tuple[int, ...]]] = []
    for g, table in enumerate(tables):
        mine_g: list[int] = []
        for node, (remote, mine) in group_block_pairs(hit, g, start, end, table, null_block).items():
            r, m = per_node.setdefault(node, ([], []))
            r += remote
            m += mine
            mine_g += mine
        filled.append((hit.groups.groups[g].kind, tuple(mine_g)))
    reads = tuple(NodeRead(n, tuple(r), tuple(m)) for n, (r, m) in sorted(per_node.items()))
    return reads, tuple(filled)


def blocks_in_range(tables: Sequence[Sequence[int]], start: int, end: int, block_size: int,
                    null_block: int) -> tuple[int, ...]:
    """Every real reader block of tokens ``[start, end)`` in any group (what a failed load loses)."""
    lo, hi = start // block_size, -(-end // block_size)
    return tuple(int(b) for t in tables for b in t[lo:hi] if int(b) != null_block)
