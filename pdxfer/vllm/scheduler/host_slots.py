"""The holder's host-memory slots: which of the M slots of the host pool are free, and which
chunks live only on the host (their GPU blocks were released after the master's entry moved to
the host copy), oldest first for eviction.

Not thread-safe: the holder calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping, Sequence

from pdxfer.kv.tiers import HOST_TIER, host_block_base, tier_of


def serves_from_host(block_ids: Sequence[int], holder_layout: Mapping[str, Any]) -> bool:
    """Whether a location names host slots of its holder: host slot s is block id N + s at the
    master, N the holder's device block count (its layout's ``num_blocks``)."""
    return tier_of(block_ids, host_block_base(holder_layout)) == HOST_TIER


class HostSlotError(ValueError):
    """A slot operation that would corrupt the bookkeeping (double free, unknown slot)."""


class HostSlots:
    """``num_slots`` host slots (0: no host tier) and an LRU of host-only chunks (key -> slots)."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise HostSlotError(f"the number of host slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        # Lowest first: reuse keeps the touched part of the pinned pool small.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()
        self._host_only: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._named: set[int] = set()  # slots of host-only chunks

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def allocate(self, k: int) -> tuple[int, ...] | None:
        """``k`` free slots, or None when fewer than ``k`` are free (nothing is taken then)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise HostSlotError(f"allocate wants a slot count >= 1, got {k!r}")
        if k > len(self._free):
            return None
        out = tuple(self._free.pop() for _ in range(k))
        self._used.update(out)
        return out

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back. Refuses (before changing anything) a slot that is not allocated or
        that a host-only chunk still names: the master may point at it."""
        slots = list(slots)
        for s in slots:
            if s not in self._used:
                raise HostSlotError(f"host slot {s} is not allocated (of {self.num_slots}): double free?")
            if s in self._named:
                raise HostSlotError(f"host slot {s} belongs to a host-only chunk: pop the chunk first")
        if len(set(slots)) != len(slots):
            raise HostSlotError(f"host slots {slots} name one slot twice")
        self._used.difference_update(slots)
        self._free.extend(slots)
        self._free.sort(reverse=True)

    # ---------------------------------------------------------------- host-only chunks (LRU)

    def add_host_only(self, key: bytes, slots: tuple[int, ...]) -> None:
        """``key`` now lives only in ``slots`` (allocated ones); it becomes the newest."""
        missing = [s for s in slots if s not in self._used]
        if missing:
            raise HostSlotError(f"host-only chunk {key.hex()[:16]} names unallocated slots {missing}")
        if key in self._host_only:
            raise HostSlotError(f"chunk {key.hex()[:16]} is already host-only")
        self._host_only[key] = tuple(slots)
        self._named.update(slots)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` as just used (newest); False when it is not host-only."""
        if key not in self._host_only:
            return False
        self._host_only.move_to_end(key)
        return True

    def pop_host_only(self, key: bytes) -> tuple[int, ...] | None:
        """Forget ``key`` as host-only; its slots (still allocated: free them next), or None."""
        slots = self._host_only.pop(key, None)
        if slots is not None:
            self._named.difference_update(slots)
        return slots

    def host_only(self, key: bytes) -> tuple[int, ...] | None:
        return self._host_only.get(key)

    def oldest(self) -> Iterator[tuple[bytes, tuple[int, ...]]]:
        """Host-only chunks, least recently used first (a snapshot: safe to change while iterating)."""
        return iter(list(self._host_only.items()))

    def __contains__(self, key: object) -> bool:
        return key in self._host_only

    def __len__(self) -> int:
        return len(self._host_only)
