"""Who holds the master's ``--max-connections`` slots, and who goes when a newcomer needs one.

A connection that has not proven itself yet (with a token: no accepted hello; without one: no
complete first request) never crowds out a client that has: at the cap the oldest unproven
connection is cut for the newcomer, and one peer address keeps at most ``max_unproven_per_peer``
unproven connections (its oldest is cut for its newest). Only proven clients filling every slot
refuse a newcomer. So silent sockets, however many and from wherever, cost each other their
slots, never a client with the token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

C = TypeVar("C", bound=Hashable)

DEFAULT_MAX_UNPROVEN_PER_PEER = 32


class ConnSlots(Generic[C]):
    """The slots of one listener: every connection holding one, the unproven ones oldest first."""

    def __init__(self, max_connections: int, max_unproven_per_peer: int = DEFAULT_MAX_UNPROVEN_PER_PEER) -> None:
        if max_connections < 1 or max_unproven_per_peer < 1:
            raise ValueError(f"max_connections ({max_connections}) and max_unproven_per_peer "
                             f"({max_unproven_per_peer}) must be >= 1")
        self.max_connections = max_connections
        self.max_unproven_per_peer = max_unproven_per_peer
        self.held: set[C] = set()
        self._unproven: OrderedDict[C, str] = OrderedDict()
        self._per_peer: dict[str, int] = {}

    def make_room(self, peer: str) -> list[C] | None:
        """The unproven connections to cut so a newcomer from ``peer`` fits (possibly none), or
        None when proven clients fill every slot (refuse it)."""
        cut: list[C] = []
        if self._per_peer.get(peer, 0) >= self.max_unproven_per_peer:
            cut.append(next(c for c, p in self._unproven.items() if p == peer))
        if len(self.held) - len(cut) >= self.max_connections:
            victim = next((c for c in self._unproven if c not in cut), None)
            if victim is None:
                return None
            cut.append(victim)
        return cut

    def add(self, conn: C, peer: str) -> None:
        """A newcomer takes a slot, unproven."""
        self.held.add(conn)
        self._unproven[conn] = peer
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1

    def prove(self, conn: C) -> None:
        """``conn`` proved itself: it keeps its slot until it closes."""
        self._forget_unproven(conn)

    def remove(self, conn: C) -> None:
        self.held.discard(conn)
        self._forget_unproven(conn)

    def unproven(self) -> int:
        return len(self._unproven)

    def _forget_unproven(self, conn: C) -> None:
        peer = self._unproven.pop(conn, None)
        if peer is not None:
            n = self._per_peer[peer] - 1
            if n:
                self._per_peer[peer] = n
            else:
                del self._per_peer[peer]
