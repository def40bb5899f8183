"""What both scheduler-side paths (reader and holder) share: the counters vLLM's stats carry,
and logging master trouble once per episode."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdxfer.contracts.phase_times import PhaseTimes

log = logging.getLogger("pdxfer.vllm.scheduler")


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_hit_tokens: int = 0  # the hit funnel's "selected": tokens a lookup chose to load
    hit_exists_tokens: int = 0  # ... "exists": published (the prefill's hint or the answer)
    hit_visible_tokens: int = 0  # ... "visible": in the master's answer
    master_errors: int = 0
    published_chunks: int = 0
    freed_chunks: int = 0
    pressure_reclaims: int = 0
    chunks_over_cap: int = 0  # new chunks not published: the cap was full and the host tier too (or off)
    late_publishes: int = 0  # publishes still in flight when the request's wait ran out
    unkeyable_requests: int = 0  # kept out: LoRA, multimodal inputs or prompt embeddings
    background_errors: int = 0  # unexpected errors in the reaper or publisher (logged, survived)
    publish_hint_waits: int = 0  # lookups that waited for chunks a prefill's hint announced
    publish_hint_timeouts: int = 0  # ... and went on without some of them
    load_benefit_loads: int = 0  # hits the load gate loaded whole (load_benefit on)
    load_benefit_partials: int = 0  # ... of which it loaded a leading part and computed the rest
    load_benefit_recomputes: int = 0  # ... that it computed entirely
    load_benefit_declined_tokens: int = 0  # held tokens it chose to compute rather than load
    publishes_unfenced: int = 0  # dropped: the device did not confirm their KV writes in time
    offloads_queued: int = 0  # host-tier copies queued (device blocks -> host slots)
    offloads_completed: int = 0  # ... that every TP rank completed
    offloads_failed: int = 0  # ... that failed on a rank or went unanswered (copy never used)
    host_moves: int = 0  # chunks whose master entry moved to the host copy (device blocks freed)
    host_evictions: int = 0  # host-only chunks unpublished to make room in the host pool
    hybrid_hits_cut: int = 0  # hybrid models: hits cut short, a window's blocks no longer held
    phases: PhaseTimes = field(default_factory=PhaseTimes)  # not a counter: taken, not diffed
    # Host-tier copies, seconds from queued to complete on every rank (taken, not diffed).
    offload_s: list[float] = field(default_factory=list)

    def counters(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}

    def take_samples(self) -> dict[str, list[float]]:
        """Every sample list since the last take, as connector-stats lists, cleared."""
        # One swap: an append from the holder's thread lands in the list taken or in the new one.
        taken, self.offload_s = self.offload_s, []
        out = {"offload_s": taken} if taken else {}
        out.update(self.phases.take())
        return out


class EpisodeLog:
    """Log master trouble once per episode (not once per request) and say when it ends."""

    def __init__(self, what: str):
        self.what = what
        self.failing = False

    def fail(self, exc: BaseException) -> None:
        if not self.failing:
            log.warning("pdxfer: %s failing (%s); recomputing instead until it recovers", self.what, exc)
        self.failing = True

    def ok(self) -> None:
        if self.failing:
            log.warning("pdxfer: %s recovered", self.what)
        self.failing = False
