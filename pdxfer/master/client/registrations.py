"""Which registration of a node this process holds, and the node's publish sequence numbers.

Every call of a node after registration names its registration (the epoch from the register reply),
so that a second process registering the same node id supersedes the first cleanly (issue 9,
hole 2). Publishes carry a per-node sequence number, increasing across everything this process
sends for the node, so that the holder can fence: "nothing I sent up to seq N may be applied any
more" (hole 1).

The table is shared by every ``MasterClient`` of this process that talks to the same master
address (a holder publishes through one client and heartbeats through another), unless a client
is given its own (``MasterClient(..., registrations=Registrations())``): two such clients behave
like two processes.
"""

from __future__ import annotations

import threading

from pdxfer.master.wire.errors import UnknownNode
from pdxfer.master.wire.records import Registration


class Registrations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[tuple[str, str], Registration] = {}
        self._seq: dict[tuple[str, str], int] = {}  # newest publish seq handed out, per node

    def put(self, master: str, reg: Registration) -> None:
        with self._lock:
            self._current[(master, reg.node_id)] = reg

    def get(self, master: str, node_id: str) -> Registration | None:
        with self._lock:
            return self._current.get((master, node_id))

    def forget(self, master: str, node_id: str, epoch: int) -> None:
        """Drop the registration if it is still ``epoch`` (deregistered or superseded)."""
        with self._lock:
            reg = self._current.get((master, node_id))
            if reg is not None and reg.epoch == epoch:
                del self._current[(master, node_id)]

    def epoch(self, master: str, node_id: str, given: int | None) -> int:
        """``given``, or the epoch of this process's registration of the node."""
        if given is not None:
            return given
        reg = self.get(master, node_id)
        if reg is None:
            raise UnknownNode(f"node {node_id!r} has no registration at master {master} in this process "
                              "(register it first, or pass epoch=)")
        return reg.epoch

    def next_seq(self, master: str, node_id: str) -> int:
        """A new publish sequence number for the node, greater than every one handed out before."""
        with self._lock:
            seq = self._seq.get((master, node_id), 0) + 1
            self._seq[(master, node_id)] = seq
            return seq

    def saw_seq(self, master: str, node_id: str, seq: int) -> None:
        """A caller chose ``seq`` itself: numbers handed out later stay above it."""
        with self._lock:
            if seq > self._seq.get((master, node_id), 0):
                self._seq[(master, node_id)] = seq

    def last_seq(self, master: str, node_id: str) -> int:
        """The newest publish sequence number handed out for the node (0: none yet)."""
        with self._lock:
            return self._seq.get((master, node_id), 0)


SHARED = Registrations()  # the process-wide table MasterClients use by default
