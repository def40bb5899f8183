"""The holder's host tier: copies held chunks to host slots, moves their master entries there
when their device blocks go, and evicts host-only chunks when the host pool is full.

On (``host_tier_mib`` > 0) when every TP rank reported host slots: each new chunk that finds free
host slots is copied there when its request finishes (an ``OffloadJob`` in the next step's
metadata; write-through). When its GPU blocks would be released (retention over, cap pressure)
and the copy is complete on every rank, the master's entry is re-published with the host ids
(``N + slot``, N = the device block count) instead of unpublished, and only once the master
accepted that move are the GPU blocks freed. Host chunks are published without a hold-until
(``retention_s=None``: the master serves them until this holder unpublishes them or its lease
ends): they stay until the host LRU evicts them, which is a compare-and-unpublish like any other,
and a slot is freed only after the master confirmed its key gone. A chunk that is host-only and
finishes again from the device is served from the host copy (its LRU entry is refreshed; the
device blocks are not held): the master never holds two locations of one key from this node.

The tier has no lock of its own: its slots and jobs change together with the held chunks' host
fields, so all of it is guarded by the holder's ``_lock``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

from pdxfer.master import MasterError, PublishFenced
from pdxfer.vllm.metadata import OffloadJob
from pdxfer.vllm.scheduler.host_slots import HostSlots
from pdxfer.vllm.scheduler.offload_jobs import JobOutcome, OffloadJobs

if TYPE_CHECKING:
    from pdxfer.vllm.scheduler.holder import HolderPath, _Held

log = logging.getLogger("pdxfer.vllm.scheduler")

# An offload job not answered by every TP rank within this long after it was sent is dropped
# (its host copy is never used): copies take milliseconds, so this only catches a lost answer.
OFFLOAD_ANSWER_BOUND_S = 30.0


class HostTier:
    """The host half of one ``HolderPath``: its host slots and host-only chunks, its offload jobs."""

    def __init__(self, holder: HolderPath, tp_size: int) -> None:
        self._h = holder
        # All guarded by the holder's _lock.
        self.slots = HostSlots(0)
        self.device_blocks = 0  # N: host slot s is published as block id N + s
        self.jobs = OffloadJobs(tp_size, OFFLOAD_ANSWER_BOUND_S)
        self._evicting = False

    def set_up(self, num_slots: int, device_blocks: int) -> None:
        """Every TP rank has ``num_slots`` host slots; the device KV cache has ``device_blocks``
        blocks (host slot s is block id ``device_blocks + s`` at the master). 0 slots: no tier."""
        if num_slots > 0 and device_blocks < 1:
            raise ValueError(f"a host tier needs the device block count, got {device_blocks}")
        with self._h._lock:
            if self.slots.used_count:
                raise RuntimeError("the host tier was set up already and holds chunks")
            self.slots = HostSlots(max(int(num_slots), 0))
            self.device_blocks = int(device_blocks)
        if num_slots > 0:
            log.info("pdxfer: host tier of %d slots per TP rank (published as block ids %d..%d)",
                     num_slots, device_blocks, device_blocks + num_slots - 1)

    @property
    def enabled(self) -> bool:
        return self.slots.num_slots > 0

    def usable(self) -> bool:
        """The master's ids for host slots start at the device block count: it must be vLLM's."""
        hp = self._h
        if not self.enabled or hp._pool is None:
            return False
        if hp._pool.num_blocks != self.device_blocks:
            log.error("pdxfer: host tier off: vLLM's block pool has %d blocks, the KV layout %d; host ids "
                      "(N + slot) would be ambiguous", hp._pool.num_blocks, self.device_blocks)
            with hp._lock:
                self.slots = HostSlots(0)
            return False
        return True

    def queue_offloads(self, new: list[tuple[bytes, tuple[int, ...]]]) -> int:
        """Queue a copy to fresh host slots for each new chunk that fits (under _lock); the slots
        still wanted for those that did not (the host LRU makes room for later chunks)."""
        wanted = 0
        for k, b in new:
            h = self._h._held.get(k)
            if h is None or not b:
                continue
            slots = self.slots.allocate(len(b))
            if slots is None:
                wanted += len(b)
                continue
            job = self.jobs.queue(k, b, slots)
            h.host, h.job_id = slots, job.job_id
            self._h.stats.offloads_queued += 1
        return wanted

    def take_offloads(self) -> list[OffloadJob]:
        """Queued offload jobs for this step's metadata, each handed out once (scheduler thread)."""
        with self._h._lock:
            self._apply_outcomes(self.jobs.expire())
            return self.jobs.take()

    def offload_output(self, worker_meta: Any) -> None:
        """A step's aggregated worker metadata (None: nothing reported): jobs done or failed.
        Held blocks over the cap (chunks held while their copies were made) move to the host now."""
        with self._h._lock:
            outcomes = self.jobs.answer(worker_meta) + self.jobs.expire()
            self._apply_outcomes(outcomes)
            over = self._h.cap.over_cap() if outcomes and self._h._pool is not None else 0
        if over > 0:
            self._h.cap.reclaim_async(over)

    def has_pending_offloads(self) -> bool:
        """Offload jobs queued or sent and not ended: vLLM keeps stepping for them (each ends
        within OFFLOAD_ANSWER_BOUND_S of being sent)."""
        with self._h._lock:
            return not self._h._closing and self.jobs.pending()

    def _apply_outcomes(self, outcomes: list[JobOutcome]) -> None:
        for o in outcomes:
            h = self._h._held.get(o.key)
            live = h is not None and h.job_id == o.job.job_id
            if not o.why:
                self._h.stats.offloads_completed += 1
                self._h.stats.offload_s.append(o.seconds)
                if live:
                    assert h is not None
                    h.job_id, h.host_valid = 0, True
                    continue
            else:
                self._h.stats.offloads_failed += 1
                log.warning("pdxfer: host copy of chunk %s (job %d) failed: %s; it is unpublished as usual "
                            "when its retention ends", o.key.hex()[:16], o.job.job_id, o.why)
                if live:
                    assert h is not None
                    h.job_id, h.host = 0, None
            # Failed, or its chunk was let go meanwhile: the master never pointed at these slots.
            self.slots.free(o.job.host_slots)

    @staticmethod
    def _movable(h: _Held) -> bool:
        return h.host_valid and h.host is not None and not h.no_move and not h.moving

    def mark_moving(self, keys: Iterable[bytes], retention_over: bool = False) -> dict[bytes, int]:
        """Of ``keys`` (held), those that move to their host copy now, with their refresh
        generation, marked moving (under _lock); ``retention_over``: the reaper's (a refused
        move is tried again shortly)."""
        moves: dict[bytes, int] = {}
        for k in keys:
            h = self._h._held.get(k)
            if h is not None and self._movable(h):
                h.moving = True
                if retention_over:
                    h.retain_until = time.monotonic() + min(1.0, self._h.cfg.lock_ttl_s)  # next try, if refused
                moves[k] = h.gen
        return moves

    def submit_move(self, moves: dict[bytes, int]) -> None:
        """Queue ``move(moves)`` on the publisher thread: after every publish queued before it."""
        try:
            self._h._publisher.submit(self.move, moves)
        except RuntimeError:  # closing
            with self._h._lock:
                for k in moves:
                    h = self._h._held.get(k)
                    if h is not None:
                        h.moving = False

    def move(self, moves: dict[bytes, int]) -> list[bytes]:
        """Re-point the master's entries of ``moves`` (key -> refresh generation when decided) at
        their host copies, on the publisher thread (after every publish queued before); release
        the device blocks of each key the master accepted. Returns the moved keys. A key a
        reader's lock pins is refused by the master and tried again later; a key refreshed
        meanwhile keeps its device blocks too (a publish of them may follow the move)."""
        hp = self._h
        assert hp.node_id is not None
        N = self.device_blocks
        with hp._lock:
            entries = [(k, [N + s for s in h.host]) for k in moves
                       if (h := hp._held.get(k)) is not None and h.host is not None]
        ok: set[bytes] = set()
        failed = False
        try:
            if entries:
                # Every device publish numbered so far is refused from now on, wherever it is (a
                # timed-out one may still land): none can re-point a moved key at freed blocks.
                hp._hot.fence(hp.node_id)
                # No hold-until: a host chunk is served until the host LRU evicts it (unpublish).
                accepted = hp._hot.publish(hp.node_id, entries, retention_s=None)
                if accepted >= len(entries):
                    ok = {k for k, _ in entries}
                elif accepted > 0:  # which ones: the same publish again, per key (idempotent)
                    ok = {k for k, b in entries if hp._hot.publish(hp.node_id, [(k, b)], retention_s=None) == 1}
        except PublishFenced as exc:  # a concurrent unpublish's fence: try again next round
            log.debug("pdxfer: host move fenced: %s", exc)
        except MasterError as exc:
            # Unknown outcome: the chunk takes the unpublish path, which copes with a lost master
            # (its host slots are freed once the key is confirmed gone).
            log.warning("pdxfer: moving %d chunks to the host tier failed (%s); unpublishing them instead",
                        len(entries), exc)
            failed = True
        moved: list[bytes] = []
        with hp._lock:
            for k, gen in moves.items():
                h = hp._held.get(k)
                if h is None:
                    continue
                h.moving = False
                if failed:
                    h.no_move, h.retain_until = True, 0.0
                    continue
                if k not in ok or h.gen != gen or h.host is None:
                    continue
                hp._drop_held(k, h)
                self.slots.add_host_only(k, h.host)
                hp.stats.host_moves += 1
                moved.append(k)
            hp._wake.notify()
        return moved

    def free_host_only(self, key: bytes) -> bool:
        """The master confirmed ``key`` gone: its host slots are free (under _lock)."""
        slots = self.slots.pop_host_only(key)
        if slots is None:
            return False
        self.slots.free(slots)
        return True

    def drop_host_only(self) -> None:
        """The master dropped every host entry of ours (superseded): free their slots."""
        with self._h._lock:
            for k, _ in self.slots.oldest():
                self.free_host_only(k)

    def evict_async(self, want_slots: int) -> None:
        """Unpublish the least recently used host-only chunks in the background until about
        ``want_slots`` slots free; a slot is freed only after the master confirmed its key gone
        (one eviction at a time, on the publisher thread: after queued publishes and moves)."""
        hp = self._h
        with hp._lock:
            if self._evicting or hp.node_id is None:
                return
            keys: list[bytes] = []
            got = 0
            for k, slots in self.slots.oldest():
                if got >= want_slots:
                    break
                keys.append(k)
                got += len(slots)
            if not keys:
                return
            self._evicting = True

        def run() -> None:
            try:
                gone = hp._unpublish(hp._hot, keys)
            except MasterError as exc:
                log.debug("pdxfer: host eviction failed: %s", exc)
                return
            finally:
                with hp._lock:
                    self._evicting = False
            with hp._lock:
                for k in gone:
                    if self.free_host_only(k):
                        hp.stats.host_evictions += 1

        try:
            hp._publisher.submit(run)
        except RuntimeError:  # closing
            with hp._lock:
                self._evicting = False

    def republish(self) -> None:
        """Publish the host-only chunks again (re-registration), on the publisher thread: an
        eviction (also there) cannot free a slot under this publish."""
        hp = self._h
        N = self.device_blocks
        with hp._lock:
            entries = [(k, [N + s for s in slots]) for k, slots in self.slots.oldest()]
        if not entries or hp.node_id is None:
            return
        try:
            n = hp._hot.publish(hp.node_id, entries, retention_s=None)
            log.info("pdxfer: re-published %d/%d host chunks after re-registration", n, len(entries))
        except MasterError as exc:
            log.warning("pdxfer: re-publish of host chunks after re-registration failed: %s", exc)

    @property
    def chunks(self) -> int:
        with self._h._lock:
            return len(self.slots)

    @property
    def slots_used(self) -> int:
        with self._h._lock:
            return self.slots.used_count
