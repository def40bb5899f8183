"""A memo of answers that is emptied when it would grow past a bound: for caches whose keys keep
coming (holders coming and going, ids that only grow) over a process's long life.

Clearing everything, rather than evicting one entry at a time, keeps a lookup as cheap as a dict
and costs only recomputing what is still in use; it suits answers that are cheap to redo and keys
that mostly stop recurring. Not locked: callers share it the way they would share a dict.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, ItemsView, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class ClearWhenFullCache(Generic[K, V]):
    """At most ``max_entries`` answers; adding one more new key first forgets them all."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._items: dict[K, V] = {}

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def put(self, key: K, value: V) -> None:
        if key not in self._items and len(self._items) >= self.max_entries:
            self._items.clear()
        self._items[key] = value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The answer for ``key``, made (and kept) on a miss; a falsy or None answer is kept too."""
        got = self._items.get(key, _MISSING)
        if got is _MISSING:
            got = make()
            self.put(key, got)
        return got  # type: ignore[return-value]

    def clear(self) -> None:
        self._items.clear()

    def items(self) -> ItemsView[K, V]:
        """What is kept now (a live view, as a dict's)."""
        return self._items.items()

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["ClearWhenFullCache"]
