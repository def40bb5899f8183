"""What a worker rank counts about its loads between two of vLLM's connector-stats collections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdxfer.contracts.phase_times import PhaseTimes


@dataclass
class WorkerStats:
    """Interval counters shipped to the scheduler through vLLM's connector stats."""

    loads_ok: int = 0
    loads_failed: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    staging_waits: int = 0  # loads that waited for room in the staging area
    staging_full: int = 0  # ... that failed: no room within the load's bound, or a block larger than it
    reads_unstopped: int = 0  # reads that did not stop within the bound: holder disconnected
    repulls: int = 0  # chunks read again from another holder after a failed read or refused lock
    host_tier_tokens_loaded: int = 0  # tokens of loads that read some chunks from a holder's host tier
    bytes_loaded_full: int = 0  # hybrid models: bytes of full-attention groups (part of bytes_loaded)
    bytes_loaded_sliding: int = 0  # ... of sliding-window groups
    bytes_loaded_state: int = 0  # ... of recurrent groups (the pages holding their state)
    transfer_s: list[float] = field(default_factory=list)
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    def add_group_bytes(self, kind: str, nbytes: int) -> None:
        """A hybrid load's bytes of one KV cache group of ``kind`` (pdxfer.kv.groups)."""
        name = f"bytes_loaded_{kind}"
        setattr(self, name, getattr(self, name) + nbytes)

    def take(self) -> dict[str, Any] | None:
        if not (self.loads_ok or self.loads_failed):
            return None
        out = {"loads_ok": self.loads_ok, "loads_failed": self.loads_failed,
               "tokens_loaded": self.tokens_loaded, "bytes_loaded": self.bytes_loaded,
               "staging_waits": self.staging_waits, "staging_full": self.staging_full,
               "reads_unstopped": self.reads_unstopped, "repulls": self.repulls,
               "host_tier_tokens_loaded": self.host_tier_tokens_loaded,
               "bytes_loaded_full": self.bytes_loaded_full, "bytes_loaded_sliding": self.bytes_loaded_sliding,
               "bytes_loaded_state": self.bytes_loaded_state, "transfer_s": list(self.transfer_s)}
        out.update(self.phases.take())
        self.loads_ok = self.loads_failed = self.tokens_loaded = self.bytes_loaded = 0
        self.staging_waits = self.staging_full = self.reads_unstopped = self.repulls = 0
        self.host_tier_tokens_loaded = self.bytes_loaded_full = self.bytes_loaded_sliding = 0
        self.bytes_loaded_state = 0
        self.transfer_s = []
        return out


class GuardDeltas:
    """What unauthenticated peers cost a holder's transport since the last report, as counters
    ``holder_<kind>`` (refused at accept, cut for newcomers, failed proofs, handshakes past their
    deadline: ``Transport.guard_counts``)."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def merge(self, stats: dict[str, Any] | None, transport: Any) -> dict[str, Any] | None:
        now = transport.guard_counts() if transport is not None else {}
        grew = {f"holder_{k}": v - self._sent.get(k, 0) for k, v in now.items() if v != self._sent.get(k, 0)}
        self._sent = now
        return {**(stats or {}), **grew} if grew else stats
