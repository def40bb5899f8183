"""One load on a worker rank as a lifecycle with explicit phases: connecting to its holders,
reading (staged reads scatter as their pieces land), validating its lock at the master,
re-pulling from another holder, then done or failed.

A :class:`Load` is one round of reads; a re-pull posts a new round (a new ``Load``) that carries
the counters of the whole load, and the old round is ``SUPERSEDED``. Every phase change goes
through :meth:`Load.enter`, which refuses a step the lifecycle does not have, so a load can never
be reported twice or validated after it failed.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdxfer.transport.base import ReadHandle, ReadState, TransferCancelled
from pdxfer.vllm.metadata import HolderRef, LoadSpec
from pdxfer.vllm.holder_routes import Route
from pdxfer.vllm.worker.staging import ScatterHandle, StagedStream


class LoadPhase(enum.Enum):
    CONNECTING = "connecting"  # some reads wait for a connection to their holder rank
    READING = "reading"  # every read is posted (staged ones piece by piece)
    VALIDATING = "validating"  # reads stopped; the master is asked whether the lock held throughout
    REPULLING = "repulling"  # a holder failed this round: looking the rest up again without it
    DONE = "done"  # loaded and validated
    FAILED = "failed"  # its blocks are reported as load errors and recomputed
    SUPERSEDED = "superseded"  # a re-pull posted the next round of this load


_NEXT = {
    LoadPhase.CONNECTING: {LoadPhase.READING, LoadPhase.VALIDATING, LoadPhase.FAILED},
    LoadPhase.READING: {LoadPhase.VALIDATING, LoadPhase.FAILED},
    LoadPhase.VALIDATING: {LoadPhase.REPULLING, LoadPhase.DONE, LoadPhase.FAILED},
    LoadPhase.REPULLING: {LoadPhase.SUPERSEDED, LoadPhase.FAILED},
    LoadPhase.DONE: set(),
    LoadPhase.FAILED: set(),
    LoadPhase.SUPERSEDED: set(),
}


class LoadPhaseError(RuntimeError):
    """A phase change the load lifecycle does not have (a bug: never wrong KV because of it)."""


class _NotPosted(ReadHandle):
    """Stands in ``Load.handles`` for a staged piece not posted yet (waiting for room):
    nothing of it can land, and it holds no load back by itself (its stream does)."""

    def poll(self) -> ReadState:
        return ReadState.DONE

    def wait(self, timeout: float) -> ReadState:
        return ReadState.DONE

    def cancel(self) -> None:
        pass

    @property
    def error(self) -> None:
        return None


NOT_POSTED = _NotPosted()


def handle_stopped(h: ReadHandle) -> bool:
    """Whether read ``h`` can no longer write (a poll that raises counts as still running)."""
    try:
        return h.poll() is not ReadState.PENDING
    except Exception:
        return False


@dataclass
class Load:
    spec: LoadSpec
    handles: list[ReadHandle]
    started: float
    nbytes: int
    phase: LoadPhase = LoadPhase.CONNECTING  # READING once no read waits for a connection
    error: str | None = None
    pending: list[tuple[HolderRef, Route, Any]] = field(default_factory=list)  # reads awaiting a connection
    validation: Future | None = None  # the master's answer to release(): did the lock hold?
    handle_nodes: list[tuple[str, int]] = field(default_factory=list)  # holder (node, rank) of each handle
    # Staged reads, piece by piece; stream_slots[i]: the index in ``handles`` of stream i's read
    # (replaced by the next piece's read once a piece was scattered).
    staged: list[StagedStream] = field(default_factory=list)
    stream_slots: list[int] = field(default_factory=list)
    staging_waited: bool = False
    unstopped: list[tuple[str, int]] = field(default_factory=list)  # holders of reads that never stopped
    read_deadline: float = 0.0  # monotonic; past it a read still pending is given up
    cancelled: bool = False
    validating_since: float = 0.0  # monotonic: reads done, release asked
    # Re-pulls (pdxfer.vllm.worker.repull). ``blame``: holders at fault for this round's failure;
    # ``unposted``: holders some of whose reads were never posted. Across rounds: when the load
    # was first posted (every round lives within its load_timeout_s), the holders skipped from
    # now on (node -> epoch), blocks no round could fill, chunks re-pulled.
    blame: set[str] = field(default_factory=set)
    unposted: set[str] = field(default_factory=set)
    round_failed: bool = False  # this round's reads failed; its release only says what to re-read
    load_started: float = 0.0
    load_tokens: int = 0  # what the whole load provides (a re-pull round's spec names only its part)
    rounds: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    repulled: int = 0
    repull_lookup: Future | None = None
    repull_from: int = 0  # the token the pending re-pull starts at
    host_reads: bool = False  # some chunks came from a holder's host tier

    def enter(self, phase: LoadPhase) -> None:
        if phase is self.phase:
            return
        if phase not in _NEXT[self.phase]:
            raise LoadPhaseError(f"load of {self.spec.req_id}: {self.phase.value} -> {phase.value} is not a "
                                 "step of a load")
        self.phase = phase

    def stopped(self) -> bool:
        """True once no read of this load can write into its blocks any more."""
        return all(h is NOT_POSTED or handle_stopped(h) for h in self.handles)

    def erred(self) -> set[str]:
        """Holders whose read failed by itself (not by our cancel, not a scatter on our device)."""
        out = set()
        for h, (node, _) in zip(self.handles, self.handle_nodes):
            err = None if h is NOT_POSTED or isinstance(h, ScatterHandle) else h.error
            if err is not None and not isinstance(err, TransferCancelled):
                out.add(node)
        return out

    def incomplete(self) -> set[str]:
        """Holders of this round with a read that did not finish (or was never posted)."""
        nodes = set(self.unposted) | set(self.blame) | {p[0].node_id for p in self.pending}
        for h, (node, _) in zip(self.handles, self.handle_nodes):
            if h is NOT_POSTED or h.poll() is not ReadState.DONE:
                nodes.add(node)
        for s, slot in zip(self.staged, self.stream_slots):
            if not s.finished:
                nodes.add(self.handle_nodes[slot][0])
        posted = {node for node, _ in self.handle_nodes}
        return nodes | {r.node_id for r in self.spec.reads if r.node_id not in posted}

    def running_reads(self) -> list[tuple[str, int]]:
        """(holder node, rank) of the transport reads still running (a scatter on our own device
        is no read: nothing on the wire stops it)."""
        return sorted({key for h, key in zip(self.handles, self.handle_nodes)
                       if h is not NOT_POSTED and not isinstance(h, ScatterHandle) and not handle_stopped(h)})
