"""KV cache groups: which blocks of a hybrid model's prompt a hit needs, and how one chunk's
location names the blocks of every group.

vLLM's hybrid KV cache manager gives each layer kind its own group of blocks: full attention
keeps every block of a prompt, sliding-window attention frees the blocks that fall out of its
window (their place in the request's block table becomes vLLM's null block). All groups share
one block pool and one block size, and the same physical block of every cache tensor belongs to
one group at a time, so moving block ``b`` of every tensor moves exactly that group's layers of
it. What a location must then say is, per chunk, the blocks of every group in group order, with
:data:`NOT_HELD` where the holder no longer has a group's block (a sliding window's freed one).

A recurrent group (Mamba, gated delta-net: vLLM's ``MambaSpec`` in its "align" cache mode) keeps
no per-token KV but one running state per request, in the last block of its table: after a
request computed ``n`` tokens, block ``cdiv(n, block_size) - 1`` holds the state after exactly
those tokens. A chunk entry names that block only where the holder's state is the state at the
entry's end (the entry ending where the finished request's computation ended); every other block
of a recurrent group is :data:`NOT_HELD`, so a hit must end exactly there.

A plain model is one full-attention group: its chunk entries are the block ids alone, exactly as
before groups existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# A chunk entry's block that the holder does not hold (the master stores block ids as uint32).
NOT_HELD = 0xFFFFFFFF
# Where a holder's registration names its KV cache groups (in each rank's layout description;
# absent: one full-attention group).
LAYOUT_KEY = "kv_groups"

FULL = "full"
SLIDING = "sliding"
STATE = "state"  # a recurrent layer's running state (Mamba, gated delta-net)
KINDS = (FULL, SLIDING, STATE)


class GroupError(ValueError):
    """Group tables or chunk entries that do not fit each other (named in the message)."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its kind and, for sliding-window attention, its window in tokens."""

    kind: str
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GroupError(f"KV cache group kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == SLIDING) != (self.window > 0):
            raise GroupError(f"a {self.kind} group {'needs' if self.kind == SLIDING else 'has no'} window, "
                             f"got {self.window}")

    def first_needed_block(self, end: int, block_size: int) -> int:
        """The first block of a prompt that attention at token ``end`` (the first one computed
        after a hit of ``end`` tokens) still reads; vLLM's allocator gives the earlier ones the
        null block (its ``get_num_skipped_tokens``)."""
        if self.kind == FULL:
            return 0
        if self.kind == STATE:
            return max(0, -(-end // block_size) - 1)  # only the state after token end - 1
        return max(0, end - self.window + 1) // block_size

    def label(self) -> str:
        return f"{self.kind}{self.window}" if self.kind == SLIDING else self.kind


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group of an instance, in vLLM's group order."""

    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise GroupError("an instance has at least one KV cache group")

    @classmethod
    def plain(cls) -> "KVGroups":
        return cls((GroupSpec(FULL),))

    @property
    def has_state(self) -> bool:
        """A recurrent group is among them: a hit must end where a holder's state ends."""
        return any(g.kind == STATE for g in self.groups)

    @property
    def hybrid(self) -> bool:
        """Anything but one full-attention group: chunk entries then follow the group table
        (a model whose every layer is sliding-window has one group, and frees blocks too)."""
        return len(self.groups) > 1 or self.groups[0].kind != FULL

    def __len__(self) -> int:
        return len(self.groups)

    def signature(self) -> str:
        """What keys and fingerprints carry: equal signatures mean equal chunk entry formats."""
        return ",".join(g.label() for g in self.groups)

    def to_wire(self) -> list[dict[str, Any]]:
        return [{"kind": g.kind, "window": g.window} for g in self.groups]

    @classmethod
    def from_wire(cls, doc: Any) -> "KVGroups":
        """A holder's table as its registration announced it; none announced: a plain model."""
        if doc is None:
            return cls.plain()
        if not isinstance(doc, list):
            raise GroupError(f"KV cache groups must be a list, got {type(doc).__name__}")
        try:
            return cls(tuple(GroupSpec(str(g["kind"]), int(g.get("window", 0))) for g in doc))
        except (TypeError, KeyError, AttributeError) as exc:
            raise GroupError(f"malformed KV cache group table {doc!r}: {exc}") from None

    # ---------------------------------------------------------------- chunk entries

    def entry(self, tables: Sequence[Sequence[int]], first_block: int, num_blocks: int,
              null_block: int | None = None, state_final: bool = False) -> tuple[int, ...] | None:
        """One chunk's location: blocks ``[first_block, first_block + num_blocks)`` of every
        group's block table, with :data:`NOT_HELD` for vLLM's null block (``null_block``: its id,
        None where no block is ever null); None when a table is shorter (the request never got
        those blocks) or a full-attention block is null. A recurrent group names only its
        table's last block, and only with ``state_final`` (the request computed exactly up to
        this entry's end, and no step will write its state again)."""
        if len(tables) != len(self.groups):
            raise GroupError(f"{len(tables)} block tables for {len(self.groups)} KV cache groups")
        out: list[int] = []
        for spec, table in zip(self.groups, tables):
            if spec.kind == STATE:
                out.extend(self._state_part(table, first_block, num_blocks, null_block, state_final))
                continue
            if first_block + num_blocks > len(table):
                return None
            part = [NOT_HELD if int(b) == null_block else int(b) for b in table[first_block:first_block + num_blocks]]
            if spec.kind == FULL and NOT_HELD in part:
                return None  # full attention needs every block: a chunk without one serves nobody
            out.extend(part)
        return tuple(out)

    @staticmethod
    def _state_part(table: Sequence[int], first_block: int, num_blocks: int, null_block: int | None,
                    state_final: bool) -> list[int]:
        part = [NOT_HELD] * num_blocks
        last = first_block + num_blocks - 1
        if state_final and last == len(table) - 1 and int(table[last]) != null_block:
            part[-1] = int(table[last])
        return part

    def group_part(self, entry: Sequence[int], group: int) -> tuple[int, ...]:
        """Group ``group``'s blocks of one chunk entry."""
        per, rest = divmod(len(entry), len(self.groups))
        if rest:
            raise GroupError(f"a chunk entry of {len(entry)} blocks does not split into {len(self.groups)} groups")
        return tuple(int(b) for b in entry[group * per:(group + 1) * per])


def held_blocks(entry: Sequence[int]) -> tuple[int, ...]:
    """The real blocks of a chunk entry (what a holder keeps references on)."""
    return tuple(int(b) for b in entry if b != NOT_HELD)
