"""A lookup's chunk locations, built on first use.

A 512-chunk lookup reply holds 512 locations; building their objects (and a block id list each)
costs more than the rest of the client's decode. Callers that only need the hit count and the lock
(a reader that re-checks a prefix, a benchmark) never pay for them; the first access of any kind
builds them all once, and from then on the sequence behaves as a list of ``ChunkLocation``.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, overload

from pdxfer.master.wire.ops import LookupReply
from pdxfer.master.wire.records import ChunkLocation


class ChunkLocations(Sequence[ChunkLocation]):
    """``ChunkLocation`` per hit chunk of a lookup reply (equal to the list of them)."""

    __slots__ = ("_keys", "_reply", "_items")

    def __init__(self, keys: Sequence[bytes], reply: LookupReply) -> None:
        self._keys: Sequence[bytes] | None = keys
        self._reply: LookupReply | None = reply
        self._items: list[ChunkLocation] | None = None

    def _list(self) -> list[ChunkLocation]:
        items = self._items
        if items is None:
            keys, reply = self._keys, self._reply
            assert keys is not None and reply is not None
            items = list(map(ChunkLocation, keys[: reply.hit], reply.holders, reply.block_lists))
            # Two threads materializing at once may both build; the first stored wins for everyone.
            if self._items is None:
                self._items = items
                self._keys = self._reply = None
            items = self._items
        return items

    def __len__(self) -> int:
        items = self._items
        if items is not None:
            return len(items)
        assert self._reply is not None
        return self._reply.hit

    @overload
    def __getitem__(self, i: int) -> ChunkLocation: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkLocation]: ...

    def __getitem__(self, i: int | slice) -> ChunkLocation | list[ChunkLocation]:
        return self._list()[i]

    def __iter__(self) -> Iterator[ChunkLocation]:
        return iter(self._list())

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, ChunkLocations):
            other = other._list()
        if isinstance(other, (list, tuple)):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._list())
