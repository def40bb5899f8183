"""A hybrid model's hit, group by group: how far the holders can serve every KV cache group, and
the block pairs of each group's reads.

Each chunk location names every group's blocks (:mod:`pdxfer.kv.groups`). A hit of ``end``
tokens needs, per group, the blocks attention at token ``end`` reads: every block of a full
attention group, only the window's blocks of a sliding group (vLLM gives the reader's other
blocks of that group its null block and never reads them), and of a recurrent group only the
block holding the state after ``end`` tokens (held only where a holder's computation ended
exactly there). A hit is servable when every such
block beyond the reader's own prefix is held; else a shorter hit (at a chunk boundary) may be,
else nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdxfer.kv.groups import NOT_HELD, STATE, GroupError, KVGroups


@dataclass(frozen=True)
class GroupHit:
    """A hit's chunk locations, chunk ``first_chunk`` on, as (holder node, chunk entry); with
    ``tail_tokens`` > 0 the last is the prompt's partial last chunk of that many tokens."""

    groups: KVGroups
    entries: tuple[tuple[str, tuple[int, ...]], ...]
    first_chunk: int
    chunk_tokens: int
    block_size: int
    tail_tokens: int = 0

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_size:
            raise GroupError(f"a hybrid model's chunks ({self.chunk_tokens} tokens) must be whole blocks of "
                             f"{self.block_size} tokens")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def full_entries(self) -> int:
        return len(self.entries) - (1 if self.tail_tokens else 0)

    def block(self, group: int, block: int) -> tuple[str, int]:
        """(holder node, its block) of prompt block ``block`` in ``group``; the block is
        NOT_HELD where the holder has none; GroupError outside the hit."""
        bpc = self.blocks_per_chunk
        chunk = block // bpc - self.first_chunk
        if 0 <= chunk < self.full_entries:
            node, entry = self.entries[chunk]
            return node, self.groups.group_part(entry, group)[block % bpc]
        if self.tail_tokens and chunk >= self.full_entries:
            at = block - (self.first_chunk + self.full_entries) * bpc
            node, entry = self.entries[-1]
            part = self.groups.group_part(entry, group)
            if 0 <= at < len(part):
                return node, part[at]
        raise GroupError(f"block {block} lies outside the hit (chunks {self.first_chunk} .. "
                         f"{self.first_chunk + len(self.entries) - 1})")

    def needed(self, group: int, local: int, end: int) -> range:
        """Prompt block indices of ``group`` a load of tokens ``[local, end)`` must fill."""
        first = max(local // self.block_size, self.groups.groups[group].first_needed_block(end, self.block_size))
        return range(first, -(-end // self.block_size))

    def servable(self, local: int, end: int) -> bool:
        return all(self.block(g, b)[1] != NOT_HELD for g in range(len(self.groups)) for b in self.needed(g, local, end))

    def shortened(self, n_full: int) -> "GroupHit":
        """The hit cut to its first ``n_full`` full chunks (no tail)."""
        return GroupHit(self.groups, self.entries[:n_full], self.first_chunk, self.chunk_tokens, self.block_size)


def servable_end(hit: GroupHit, local: int, end: int) -> tuple[int, GroupHit]:
    """The longest hit not past ``end`` at which the holders serve every group, and the hit cut
    to it: ``end`` itself, else the longest chunk boundary beyond ``local``; (``local``, hit)
    when none is."""
    if end > local and hit.servable(local, end):
        return end, hit
    for n in range(min(hit.full_entries, (end // hit.chunk_tokens) - hit.first_chunk), 0, -1):
        cut = (hit.first_chunk + n) * hit.chunk_tokens
        if cut <= local:
            break
        short = hit.shortened(n)
        if short.servable(local, cut):
            return cut, short
    return local, hit


def group_block_pairs(hit: GroupHit, group: int, local: int, end: int, table: Sequence[int],
                      null_block: int) -> dict[str, tuple[list[int], list[int]]]:
    """Per holder node, (its blocks, reader blocks) filling ``group``'s blocks of tokens
    ``[local, end)`` into the reader's block table ``table`` of that group; GroupError where a
    needed block is not held or the reader's table disagrees with the window (a null block
    where one is needed)."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    spec = hit.groups.groups[group]
    if spec.kind == STATE and len(table) != -(-end // hit.block_size):
        # vLLM reads a recurrent group's running state from its table's last block.
        raise GroupError(f"group {group} (state): the reader's block table has {len(table)} blocks, a hit of {end} "
                         f"tokens keeps its state in block {-(-end // hit.block_size) - 1} as the last")
    for b in hit.needed(group, local, end):
        if b >= len(table):
            raise GroupError(f"group {group}: the reader's block table has {len(table)} blocks, the load needs "
                             f"block {b}")
        (node, src), dst = hit.block(group, b), int(table[b])
        if src == NOT_HELD:
            raise GroupError(f"group {group}: block {b} of the hit is not held by its holder")
        if dst == null_block:
            raise GroupError(f"group {group} ({hit.groups.groups[group].label()}): the reader's block {b} is vLLM's "
                             "null block, but the window needs it")
        remote, mine = out.setdefault(node, ([], []))
        remote.append(src)
        mine.append(dst)
    return out
