"""Offload jobs of the host tier on the scheduler side: queued (waiting for the next step's
metadata), sent (waiting for every TP rank's answer), and what the answers say.

Not thread-safe: the holder calls it under its own lock.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from pdxfer.vllm.metadata import OffloadJob


@dataclass
class JobState:
    key: bytes
    job: OffloadJob
    queued_at: float  # monotonic
    sent_at: float | None = None  # monotonic; None while queued
    done: int = 0  # ranks that reported the copy complete


@dataclass(frozen=True)
class JobOutcome:
    key: bytes
    job: OffloadJob
    why: str = ""  # empty: complete on every rank
    seconds: float = 0.0  # from queued to this outcome


class OffloadJobs:
    """Jobs by id; a job ends complete when ``tp_size`` ranks reported it done, failed on any
    rank's failure or when no complete answer came within ``answer_bound_s`` of sending it."""

    def __init__(self, tp_size: int, answer_bound_s: float) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self.answer_bound_s = answer_bound_s
        self._ids = itertools.count(1)
        self._jobs: dict[int, JobState] = {}
        self._queued: list[int] = []

    def queue(self, key: bytes, device_blocks: tuple[int, ...], host_slots: tuple[int, ...],
              now: float | None = None) -> OffloadJob:
        if len(device_blocks) != len(host_slots) or not device_blocks:
            raise ValueError(f"an offload copies one block per slot: {len(device_blocks)} blocks, "
                             f"{len(host_slots)} slots")
        job = OffloadJob(next(self._ids), tuple(device_blocks), tuple(host_slots))
        self._jobs[job.job_id] = JobState(key, job, time.monotonic() if now is None else now)
        self._queued.append(job.job_id)
        return job

    def take(self, now: float | None = None) -> list[OffloadJob]:
        """The queued jobs, each handed out once: they go into this step's metadata."""
        now = time.monotonic() if now is None else now
        out = []
        for jid in self._queued:
            st = self._jobs.get(jid)
            if st is not None:
                st.sent_at = now
                out.append(st.job)
        self._queued = []
        return out

    def answer(self, worker_meta: Any, now: float | None = None) -> list[JobOutcome]:
        """Jobs a step's (aggregated) worker metadata ended: complete or failed."""
        out: list[JobOutcome] = []
        if worker_meta is None:
            return out
        now = time.monotonic() if now is None else now
        for jid, why in dict(getattr(worker_meta, "offloads_failed", None) or {}).items():
            st = self._jobs.pop(int(jid), None)
            if st is not None:
                out.append(JobOutcome(st.key, st.job, str(why) or "failed", now - st.queued_at))
        for jid, n in dict(getattr(worker_meta, "offloads_done", None) or {}).items():
            st = self._jobs.get(int(jid))
            if st is None:
                continue
            st.done += int(n)
            if st.done >= self.tp_size:
                del self._jobs[int(jid)]
                out.append(JobOutcome(st.key, st.job, seconds=now - st.queued_at))
        return out

    def expire(self, now: float | None = None) -> list[JobOutcome]:
        """Sent jobs without a complete answer within the bound: failed."""
        now = time.monotonic() if now is None else now
        late = [jid for jid, st in self._jobs.items()
                if st.sent_at is not None and now - st.sent_at > self.answer_bound_s]
        out = []
        for jid in late:
            st = self._jobs.pop(jid)
            out.append(JobOutcome(st.key, st.job, f"no answer from every TP rank within {self.answer_bound_s:g} s "
                                                  f"({st.done}/{self.tp_size} done)", now - st.queued_at))
        return out

    def drop_all(self) -> list[JobOutcome]:
        out = [JobOutcome(st.key, st.job, "holder closing") for st in self._jobs.values()]
        self._jobs.clear()
        self._queued = []
        return out

    def pending(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)
