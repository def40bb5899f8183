"""The holder (producer) path of the scheduler half: publish a finished request's full chunks,
hold their blocks, keep held blocks under a cap, and give them back only after the master's
compare-and-unpublish (the reaper), re-publishing what is held when the master forgot this node.

Holding published blocks: instead of vLLM's delay-free (``request_finished`` -> True, which
keeps the engine stepping until the worker reports the send finished, i.e. a busy engine while
anything is held), the holder takes one extra reference per held chunk on the blocks in vLLM's
block pool. The request frees its own references as usual; the blocks stay allocated (and in
the local prefix cache) until pdxfer drops its reference. Dropping happens only after the
master's compare-and-unpublish succeeded (no valid reader lock), decided on a background thread
that sleeps until the next retention deadline; the block-pool call itself is made on the
scheduler thread at its next hook (every step, and before any new request is allocated), since
vLLM's block pool is not thread-safe. An idle engine therefore costs nothing.

The host tier (``host_tier_mib`` > 0, when every TP rank reported host slots): each new chunk
that finds free host slots is copied there when its request finishes (an ``OffloadJob`` in the
next step's metadata; write-through). When its GPU blocks would be released (retention over, cap
pressure) and the copy is complete on every rank, the master's entry is re-published with the host
ids (``N + slot``, N = the device block count) instead of unpublished, and only once the master
accepted that move are the GPU blocks freed. Host chunks are published without a hold-until
(``retention_s=None``: the master serves them until this holder unpublishes them or its lease
ends): they stay until the host LRU evicts them, which is a compare-and-unpublish like any other,
and a slot is freed only after the master confirmed its key gone. A chunk that is host-only and
finishes again from the device is served from the host copy (its LRU entry is refreshed; the
device blocks are not held): the master never holds two locations of one key from this node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from pdxfer.kv.keys import IncrementalHasher
from pdxfer.master import MasterError, MasterUnavailable, NodeInfo, NodeSession, PublishFenced
from pdxfer.kv.chunks import chunk_span
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.vllm.faults.hooks import test_hook_float
from pdxfer.vllm.scheduler.block_pool import BlockPoolHolder
from pdxfer.vllm.scheduler.host_slots import HostSlots
from pdxfer.vllm.metadata import OffloadJob
from pdxfer.vllm.scheduler.offload_jobs import JobOutcome, OffloadJobs
from pdxfer.vllm.scheduler.scheduler_state import EpisodeLog, SchedulerStats
from pdxfer.vllm.write_fence import WriteFence

log = logging.getLogger("pdxfer.vllm.scheduler")


@dataclass
class _Held:
    blocks: tuple[int, ...]
    retain_until: float  # monotonic; pushed forward while unpublish is refused
    retention_end: float = 0.0  # when retention first ran out (the master stops serving then)
    host: tuple[int, ...] | None = None  # host slots of its copy (reserved while the job runs)
    job_id: int = 0  # the offload job still filling ``host`` (0: none)
    host_valid: bool = False  # the copy completed on every rank: the chunk may move there
    no_move: bool = False  # never move (never published from the device, or a move errored)
    moving: bool = False  # a move is queued on the publisher thread
    gen: int = 0  # bumped by every refresh: a move decided before one keeps the device blocks
    last_seq: int = 0  # the publish sequence number of the newest publish queued for it
    leaving: bool = False  # an unpublish of it is under way: nothing may publish it again meanwhile


# How fast the room kept for the largest recent request shrinks (per request) when requests get
# smaller: a burst of long prompts is remembered for a few dozen requests.
_ROOM_DECAY = 0.95

# An offload job not answered by every TP rank within this long after it was sent is dropped
# (its host copy is never used): copies take milliseconds, so this only catches a lost answer.
OFFLOAD_ANSWER_BOUND_S = 30.0


class HolderPath:
    def __init__(self, cfg: ConnectorConfig, *, block_size: int, hot: Any, bg: Any,
                 stats: SchedulerStats, fence: WriteFence | None = None, tp_size: int = 1) -> None:
        self.cfg = cfg
        self._fence = fence  # None: every write is complete when its request finishes (no device)
        self._awaiting_fence: set[bytes] = set()  # held, queued, writes not yet confirmed: never re-published
        self.block_size = block_size
        self._hot = hot  # publishes and pressure unpublishes, in order, on the publisher thread
        self._bg = bg  # reaper and re-publish
        self.stats = stats
        self.node_id: str | None = None
        self._pool: BlockPoolHolder | None = None
        self._publish_log = EpisodeLog("master publishes")
        # Held chunks, oldest first. Guarded by _lock: the reaper and re-registration threads read it.
        self._lock = threading.Lock()
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        self._held_block_refs: dict[int, int] = {}
        self._to_free: deque[tuple[int, ...]] = deque()  # filled by the reaper, drained here
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._session: Any = None
        self._reaper: threading.Thread | None = None
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="pdxfer-publish")  # keeps order
        self._master_unreachable_since: float | None = None
        self._superseded = False
        self._reclaiming = False
        self._room_wanted = 0  # blocks the largest recent request took (decaying): kept free
        self.stale_after_s_override: float | None = None  # tests shorten the last-resort bound
        # Host tier (all guarded by _lock): slots and host-only chunks, offload jobs.
        self._host = HostSlots(0)
        self._device_blocks = 0  # N: host slot s is published as block id N + s
        self._jobs = OffloadJobs(tp_size, OFFLOAD_ANSWER_BOUND_S)
        self._evicting = False

    def bind_block_pool(self, pool: Any) -> None:
        self._pool = pool if isinstance(pool, BlockPoolHolder) else BlockPoolHolder(pool)

    def set_host_tier(self, num_slots: int, device_blocks: int) -> None:
        """Every TP rank has ``num_slots`` host slots; the device KV cache has ``device_blocks``
        blocks (host slot s is block id ``device_blocks + s`` at the master). 0 slots: no tier."""
        if num_slots > 0 and device_blocks < 1:
            raise ValueError(f"a host tier needs the device block count, got {device_blocks}")
        with self._lock:
            if self._host.used_count:
                raise RuntimeError("the host tier was set up already and holds chunks")
            self._host = HostSlots(max(int(num_slots), 0))
            self._device_blocks = int(device_blocks)
        if num_slots > 0:
            log.info("pdxfer: host tier of %d slots per TP rank (published as block ids %d..%d)",
                     num_slots, device_blocks, device_blocks + num_slots - 1)

    @property
    def host_enabled(self) -> bool:
        return self._host.num_slots > 0

    def _host_tier_usable(self) -> bool:
        """The master's ids for host slots start at the device block count: it must be vLLM's."""
        if not self.host_enabled or self._pool is None:
            return False
        if self._pool.num_blocks != self._device_blocks:
            log.error("pdxfer: host tier off: vLLM's block pool has %d blocks, the KV layout %d; host ids "
                      "(N + slot) would be ambiguous", self._pool.num_blocks, self._device_blocks)
            with self._lock:
                self._host = HostSlots(0)
            return False
        return True

    def start(self, info: NodeInfo) -> None:
        """Register the node under a lease and start the reaper."""
        self.node_id = info.node_id
        self._session = NodeSession(self._bg, info, lease_ttl_s=self.cfg.lease_ttl_s,
                                    on_reregistered=self._republish, on_superseded=self._on_superseded)
        self._session.start()
        self._reaper = threading.Thread(target=self._reap_loop, name="pdxfer-reaper", daemon=True)
        self._reaper.start()
        log.info("pdxfer: holder node %s registered with master %s (transport %s)",
                 info.node_id, self.cfg.master, info.transport)

    def _on_superseded(self) -> None:
        """Another process registered our node id (NodeSession logged the ERROR): the master
        dropped our entries, and the locks on them, when it took the new registration, and refuses
        our calls from now on. Publish nothing more; everything held goes back to vLLM."""
        self._superseded = True
        with self._lock:
            keys = list(self._held)
        self._forget(keys)
        with self._lock:  # the master dropped our host entries too
            for k, _ in self._host.oldest():
                self._free_host_only(k)

    @property
    def max_lock_ttl_s(self) -> float:
        """The longest reader lock the master grants on our entries: every force-free waits at
        least this long (our own lock_ttl_s says nothing about other readers' locks)."""
        reg = self._hot.registration(self.node_id) if self.node_id else None
        return float(reg.max_lock_ttl_s) if reg is not None else max(self.cfg.lock_ttl_s, 3600.0)

    @property
    def stale_after_s(self) -> float:
        """After this long past retention, a key the master never confirmed gone is freed anyway."""
        if self.stale_after_s_override is not None:
            return self.stale_after_s_override
        return max(10 * self.max_lock_ttl_s, 60.0)

    def request_finished(self, req_id: str, tokens: Sequence[int] | None, block_ids: Sequence[int],
                         hasher: IncrementalHasher | None,
                         new_hasher: Callable[[], IncrementalHasher], write_seq: int = 0) -> int:
        """Publish every full chunk of a finished request and hold its blocks. ``tokens``: the
        tokens whose KV is in ``block_ids`` (None: nothing publishable, e.g. aborted);
        ``hasher``: the request's own, if the reader path made one; ``new_hasher()`` makes one;
        ``write_seq``: the step whose completion on the device the publish waits for (0: none).
        Returns how many leading tokens the queued publish covers (0: none), the decode's hint."""
        try:
            self.drain_frees()
            if tokens is None or self._pool is None or self.node_id is None:
                return 0
            C = self.cfg.chunk_tokens
            chunk_blocks: list[tuple[int, ...]] = []
            for i in range(min(len(tokens), len(block_ids) * self.block_size) // C):
                blocks = self._chunk_blocks(i, block_ids)
                if blocks is None:
                    break
                chunk_blocks.append(blocks)
            n_chunks = len(chunk_blocks)
            tail_blocks = self._tail_blocks(len(tokens), n_chunks, block_ids)
            if n_chunks == 0 and tail_blocks is None:
                return 0
            if hasher is None:
                hasher = new_hasher()
            t0 = time.perf_counter()
            keys = hasher.update(list(tokens))[:n_chunks]
            if tail_blocks is not None:
                # The partial last chunk: a decode of this very prompt then loads everything but
                # its last token, not just the full chunks.
                tail = hasher.tail(list(tokens))
                if tail is not None:
                    keys.append(tail)
                    chunk_blocks.append(tail_blocks)
            t1 = time.perf_counter()
            covered = self._publish(keys, chunk_blocks, req_id, write_seq)
            t2 = time.perf_counter()
            if t2 - t0 > 0.02:
                log.warning("pdxfer: publishing %d chunks of %s took %.1f ms (hash %.1f ms)", n_chunks,
                            req_id, (t2 - t0) * 1e3, (t1 - t0) * 1e3)
            # The tail is the last key: covering it means covering the whole request.
            return len(tokens) if covered > n_chunks else covered * C
        except Exception as exc:  # publishing is best effort; never fail vLLM's request
            log.exception("pdxfer: publishing %s failed: %s", req_id, exc)
            return 0

    def _tail_blocks(self, n_tokens: int, n_chunks: int, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        """Blocks of the tokens after the last full chunk, when they are the whole rest of the
        request, else None. With blocks larger than a chunk that is the one block holding them,
        which may hold earlier chunks too (a reader takes it as the source of all its tokens up to
        the prompt's end: they are this very prompt's)."""
        C, bs = self.cfg.chunk_tokens, self.block_size
        start = n_chunks * C
        if n_tokens <= start or n_tokens - start >= C:
            return None
        end_block = -(-n_tokens // bs)
        if end_block > len(block_ids):
            return None
        return tuple(int(b) for b in block_ids[start // bs:end_block])

    def _chunk_blocks(self, chunk: int, block_ids: Sequence[int]) -> tuple[int, ...] | None:
        span = chunk_span(chunk, self.cfg.chunk_tokens, self.block_size)
        if span.first_block + span.num_blocks > len(block_ids):
            return None
        return tuple(int(b) for b in block_ids[span.first_block: span.first_block + span.num_blocks])

    def _publish(self, keys: list[bytes], blocks: list[tuple[int, ...]], req_id: str = "",
                 write_seq: int = 0) -> int:
        """Hold and queue the publish of ``keys``; how many leading keys it covers (the cap may
        let only a prefix of the new ones through), 0 when nothing was queued."""
        assert self._pool is not None and self.node_id is not None
        if self._superseded:
            return 0
        now = time.monotonic()
        retain = test_hook_float("retention_s") or self.cfg.retention_s
        host_ok = self._host_tier_usable()
        with self._lock:
            # Host-only chunks are served from their host copy: refreshed in the host LRU, never
            # published from the device too (one location per key and node at the master).
            on_host = {k for k in keys if k not in self._held and self._host.touch(k)}
            new = [(k, b) for k, b in zip(keys, blocks) if k not in self._held and k not in on_host]
        if new:
            new = self._fit_under_cap(new)  # may reclaim (free) old chunks: before the refresh
        # Chunks already held are wanted again: extend their retention here and at the master,
        # with the blocks already held for them. The reaper frees only chunks still past their
        # retention when its unpublish returns, so a refreshed chunk is never freed under it.
        refresh: list[tuple[bytes, tuple[int, ...]]] = []
        with self._lock:
            # Sequence number and registration are fixed now, when the publish is queued: a fence
            # (every free goes through one) or a newer registration then refuses it wherever it is.
            seq = self._hot.next_publish_seq(self.node_id)
            for k in keys:
                h = self._held.get(k)
                if h is not None:
                    h.retain_until, h.retention_end = now + retain, 0.0
                    h.gen += 1
                    h.last_seq = seq
                    self._held.move_to_end(k)
                    refresh.append((k, h.blocks))
        if not new and not refresh:
            return next((i for i, k in enumerate(keys) if k not in on_host), len(keys))
        for _, b in new:
            self._pool.hold(b)
        # Bookkeeping first: from here on the reaper owns these chunks whatever the master says.
        with self._lock:
            if write_seq > 0 and self._fence is not None:
                self._awaiting_fence.update(k for k, _ in new)
            for k, b in new:
                self._held[k] = _Held(b, now + retain, last_seq=seq)
                for x in b:
                    self._held_block_refs[x] = self._held_block_refs.get(x, 0) + 1
            host_wanted = self._queue_offloads(new) if host_ok else 0
            self._wake.notify()
        if host_wanted:
            self._evict_host_async(host_wanted)
        entries = [(k, list(b)) for k, b in refresh + new]
        reg = self._hot.registration(self.node_id)
        fut = self._publisher.submit(self._send_publish, entries, [k for k, _ in new], len(refresh), retain,
                                     seq, reg.epoch if reg is not None else None, req_id, write_seq)
        # The decode's lookup must not race this publish. By default nothing waits here: the
        # request's kv_transfer_params carry a hint and the decode waits for the chunks instead
        # (bounded), so the prefill's answer is never delayed by a master round trip.
        if self.cfg.publish_wait_s > 0:
            try:
                fut.result(timeout=self.cfg.publish_wait_s)
            except FutureTimeout:
                self.stats.late_publishes += 1
        covered = {k for k, _ in refresh} | {k for k, _ in new} | on_host
        return next((i for i, k in enumerate(keys) if k not in covered), len(keys))

    def _send_publish(self, entries: list[tuple[bytes, list[int]]], new_keys: list[bytes], n_refresh: int,
                      retain: float, seq: int, epoch: int | None, req_id: str = "", write_seq: int = 0) -> None:
        assert self.node_id is not None
        fenced = self._fenced(req_id, write_seq)
        with self._lock:
            self._awaiting_fence.difference_update(new_keys)
            # Only what is still held on the same blocks: a pressure reclaim queued before this
            # publish (on this thread) may have let a refreshed chunk go.
            entries = [(k, b) for k, b in entries if self._still_held(k, b)]
        if not fenced:
            self._due_now(new_keys, seq)  # never published: the reaper frees them at once
            return
        if not entries:
            return
        delay = test_hook_float("publish_delay_s")  # tests: a publish slower than the decode's lookup
        if delay:
            time.sleep(delay)
        try:
            try:
                accepted = self._hot.publish(self.node_id, entries, retention_s=retain, seq=seq, epoch=epoch)
            except PublishFenced:
                # A free elsewhere fenced everything queued before it, this publish too. What we
                # still hold, and no unpublish is taking, may be published again under a new
                # number taken in the same critical section: a free that picks a chunk after
                # this fences the retry, one that picked it before is skipped here.
                with self._lock:
                    entries = [(k, b) for k, b in entries if self._still_held(k, b, seq, settled=True)]
                    retry_seq = self._hot.next_publish_seq(self.node_id)
                    for k, _ in entries:
                        self._held[k].last_seq = retry_seq
                if not entries:
                    return
                accepted = self._hot.publish(self.node_id, entries, retention_s=retain, seq=retry_seq, epoch=epoch)
        except MasterUnavailable as exc:
            # A timeout may hide an applied publish: keep the blocks as if published, so the
            # reaper unpublishes (or, failing that, frees) them through the normal path.
            self._publish_log.fail(exc)
            return
        except MasterError as exc:
            # Refused (unknown node, auth): nothing of it was stored, but a re-registration may
            # re-publish these held keys meanwhile, so they are not freed here: the reaper's
            # fenced unpublish decides, at once.
            self._publish_log.fail(exc)
            self._due_now(new_keys, seq)
            return
        except Exception as exc:
            # Unknown outcome, as for a timeout: keep the blocks; the reaper unpublishes them.
            self.stats.background_errors += 1
            log.exception("pdxfer: publishing failed unexpectedly: %s", exc)
            return
        self._publish_log.ok()
        # Entries the master did not accept stay held until retention: freeing them early would
        # be unsafe if the master accepted a different subset than we think.
        self.stats.published_chunks += max(int(accepted) - n_refresh, 0)

    def _fenced(self, req_id: str, write_seq: int) -> bool:
        """Whether the device completed the KV writes of step ``write_seq`` on every rank, waiting
        at most ``publish_fence_wait_s`` (here, on the publisher thread: never on the step path).
        A publish of blocks whose writes may still be in flight would let a reader copy garbage."""
        if self._fence is None or write_seq <= 0:
            return True
        if self._fence.wait_for(write_seq, self.cfg.publish_fence_wait_s):
            return True
        if self._closing:  # shutting down: the fence closed under the wait, nothing to report
            return False
        self.stats.publishes_unfenced += 1
        log.warning("pdxfer: not publishing %s: the device did not confirm the KV writes of its step %d "
                    "within %.2f s (steps completed per TP rank: %s); readers compute it themselves",
                    req_id, write_seq, self.cfg.publish_fence_wait_s, self._fence.slots())
        return False

    def _still_held(self, key: bytes, blocks: Sequence[int], seq: int = 0, settled: bool = False) -> bool:
        """Whether ``key`` is held on ``blocks`` (under _lock); ``seq``: and the publish numbered
        ``seq`` is still its newest (a later one publishes it itself); ``settled``: and no unpublish
        is under way for it."""
        h = self._held.get(key)
        return (h is not None and list(h.blocks) == list(blocks) and (not seq or h.last_seq == seq)
                and not (settled and h.leaving))

    def _due_now(self, keys: Iterable[bytes], seq: int) -> None:
        """The publish numbered ``seq`` never stored ``keys``: the reaper frees them at once,
        except those a later publish (a refresh queued behind it) covers now."""
        with self._lock:
            for k in keys:
                h = self._held.get(k)
                if h is not None and h.last_seq == seq:
                    h.retain_until = 0.0
                    h.no_move = True  # the master never had its device entry: nothing to move
            self._wake.notify()

    def _fit_under_cap(self, new: list[tuple[bytes, tuple[int, ...]]]) -> list[tuple[bytes, tuple[int, ...]]]:
        """Keep held blocks under ``max_held_fraction`` of the pool: publish only the leading
        chunks that fit (a prefix is what readers use), and reclaim the oldest unlocked chunks in
        the background early enough that the next request fits whole (a P/D decode wants the
        whole prompt its prefill just computed): room for the largest recent request is kept."""
        assert self._pool is not None
        cap = self.held_blocks_cap
        with self._lock:  # the reaper thread mutates the held set: work on a snapshot
            held_now = set(self._held_block_refs)
        want = {x for _, b in new for x in b} - held_now
        self._room_wanted = max(len(want), int(self._room_wanted * _ROOM_DECAY))
        out: list[tuple[bytes, tuple[int, ...]]] = []
        seen: set[int] = set()
        for k, b in new:
            add = {x for x in b if x not in held_now and x not in seen}
            if len(held_now) + len(seen) + len(add) > cap:
                break
            seen |= add
            out.append((k, b))
        # Room comes from the master's compare-and-unpublish: ask in the background (never block
        # the step); the blocks return at a later scheduler hook, before the next request.
        over = len(held_now) + len(want) - (cap - min(self._room_wanted, cap))
        if over > 0:
            self._reclaim_async(over, keep={k for k, _ in out})
        return out

    def _reclaim_async(self, want_blocks: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Unpublish the oldest held chunks in the background until about ``want_blocks`` blocks
        free (never those in ``keep``: being published now); their blocks return to vLLM at the
        scheduler's next hook (one reclaim at a time)."""
        assert self._pool is not None and self.node_id is not None
        with self._lock:
            if self._reclaiming:
                return
            candidates: list[bytes] = []
            freed: set[int] = set()
            for k, h in self._held.items():  # oldest first
                if len(freed) >= want_blocks:
                    break
                if k in keep or h.moving or h.leaving:
                    continue
                candidates.append(k)
                freed.update(x for x in h.blocks if self._held_block_refs.get(x, 0) <= 1)
            if not candidates:
                return
            self._reclaiming = True
            moves = self._mark_moving(candidates)
            candidates = [k for k in candidates if k not in moves]
            self._mark_leaving(candidates)

        def run() -> None:
            moved: list[bytes] = []
            done: list[bytes] = []
            try:
                moved = self._move(moves) if moves else []
                done = self._unpublish(self._hot, candidates) if candidates else []
            except MasterError as exc:
                log.debug("pdxfer: pressure unpublish failed: %s", exc)
            finally:
                self._forget(done)  # before the marks go, so the reaper never picks what this frees
                with self._lock:
                    self._reclaiming = False
                    self._mark_leaving(candidates, False)
                    self._wake.notify()  # the reaper skipped them meanwhile: those still held may be due
            self.stats.pressure_reclaims += len(done) + len(moved)

        # On the publisher thread: an unpublish must not overtake a queued publish of the same key.
        try:
            self._publisher.submit(run)
        except RuntimeError:  # closing
            with self._lock:
                self._reclaiming = False
                self._mark_leaving(candidates, False)
                for k in moves:
                    h = self._held.get(k)
                    if h is not None:
                        h.moving = False

    def _forget(self, keys: Iterable[bytes], only_if_due: bool = False) -> None:
        """Keys no reader can lock any more: queue their blocks for release on the scheduler thread.
        ``only_if_due``: skip keys whose retention was extended meanwhile (re-published)."""
        with self._lock:
            now = time.monotonic()
            for k in keys:
                h = self._held.get(bytes(k))
                if h is None or (only_if_due and h.retain_until > now):
                    continue
                self._drop_held(bytes(k), h)
                # Its host copy goes too (the master points at neither now); a copy still being
                # made keeps its slots until its job ends (the worker may be writing them).
                if h.host is not None and not h.job_id:
                    self._host.free(h.host)

    def _drop_held(self, key: bytes, h: _Held) -> None:
        """Stop holding ``key``'s device blocks: queued for release on the scheduler thread (under _lock)."""
        del self._held[key]
        for x in h.blocks:
            n = self._held_block_refs.get(x, 0) - 1
            if n <= 0:
                self._held_block_refs.pop(x, None)
            else:
                self._held_block_refs[x] = n
        self._to_free.append(h.blocks)
        self.stats.freed_chunks += 1

    def drain_frees(self) -> None:
        """Return blocks the reaper let go to vLLM's pool (scheduler thread only)."""
        if self._pool is None:
            return
        while self._to_free:
            try:
                blocks = self._to_free.popleft()
            except IndexError:
                break
            self._pool.unhold(blocks)

    def has_pending_frees(self) -> bool:
        return bool(self._to_free)

    @property
    def held_chunks(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def held_blocks(self) -> int:
        with self._lock:
            return len(self._held_block_refs)

    @property
    def held_blocks_cap(self) -> int:
        """The most blocks this holder keeps published (0 before vLLM handed over its pool)."""
        return int(self.cfg.max_held_fraction * self._pool.num_blocks) if self._pool is not None else 0

    def _reap_loop(self) -> None:
        """Unpublish chunks whose retention is over; sleeps until the next deadline (no polling).
        Survives any error: a dead reaper would never return held blocks to vLLM."""
        while True:
            try:
                if self._reap_step():
                    return
            except Exception as exc:
                self.stats.background_errors += 1
                log.exception("pdxfer: the holder's reaper hit an unexpected error (retrying in 1 s): %s", exc)
                with self._lock:
                    if self._closing:
                        return
                    self._wake.wait(1.0)

    def _reap_step(self) -> bool:
        """One round of the reaper; True when the holder is closing."""
        with self._lock:
            if self._closing:
                return True
            now = time.monotonic()
            # Not those a pressure reclaim is unpublishing: one unpublish, and one owner of the mark, per chunk.
            due = [k for k, h in self._held.items() if h.retain_until <= now and not h.moving and not h.leaving]
            if not due:
                nxt = min((h.retain_until for h in self._held.values() if not h.leaving), default=None)
                self._wake.wait(None if nxt is None else max(nxt - now, 0.01))
                return False
            # Chunks with a complete host copy move there instead (on the publisher thread).
            moves = self._mark_moving(due, retention_over=True)
            for k in moves:
                h = self._held[k]
                h.retention_end = h.retention_end or now
            due = [k for k in due if k not in moves]
            self._mark_leaving(due)
        assert self.node_id is not None
        if moves:
            self._submit_move(moves)
            if not due:
                return False
        try:
            return self._unpublish_due(due, now)
        finally:
            with self._lock:
                self._mark_leaving(due, False)

    def _unpublish_due(self, due: list[bytes], now: float) -> bool:
        """The reaper's unpublish of chunks past their retention (marked leaving); True when closing."""
        try:
            done = self._unpublish(self._bg, due)
            self._master_unreachable_since = None
            # The master reports keys it never had as gone, so "not removed" means locked.
            # Past its retention an entry is never served, so no lock on it can be newer than
            # its retention end: after a generous multiple of the lock TTL the key is freed
            # anyway, a last resort should a master misbehave.
            gone = set(done)
            with self._lock:
                stale = [k for k in due if k not in gone and k in self._held
                         and now - (self._held[k].retention_end or now) > self.stale_after_s]
            if stale:
                log.warning("pdxfer: %d held chunks were never confirmed unpublished; freeing them",
                            len(stale))
                done = list(done) + stale
        except MasterError as exc:
            done = []
            t0 = self._master_unreachable_since = self._master_unreachable_since or now
            # After lease + the lock TTL cap without any answer from the master (heartbeats
            # count), it has dropped our entries and every lock it granted has expired: freeing
            # can no longer hand a reader wrong bytes.
            last_ok = self._session.last_ok_at if self._session is not None else None
            if now - max(t0, last_ok or 0.0) > self.cfg.lease_ttl_s + self.max_lock_ttl_s:
                log.warning("pdxfer: master unreachable for %.0f s (%s): freeing %d held chunks",
                            now - t0, exc, len(due))
                done = due
        self._forget(done, only_if_due=True)
        with self._lock:
            # Locked (or not yet unpublishable) chunks: try again shortly, not in a tight loop.
            retry = time.monotonic() + min(1.0, self.cfg.lock_ttl_s)
            for k in due:
                h = self._held.get(k)
                if h is not None and h.retain_until <= now:  # not re-published meanwhile
                    h.retention_end = h.retention_end or now
                    h.retain_until = retry
            if self._closing:
                return True
            self._wake.wait(0.05 if done else 0.0)
        return False

    def _unpublish(self, client: Any, keys: list[bytes]) -> list[bytes]:
        """Keys the master no longer serves for us, after fencing every publish queued so far: a
        publish that timed out here, or still waits in a queue or a socket, can never land after
        we free the blocks it names."""
        assert self.node_id is not None
        return client.unpublish_if_unlocked(self.node_id, keys,
                                            fence_seq=client.last_publish_seq(self.node_id))

    # ------------------------------------------------------------------ host tier

    def _queue_offloads(self, new: list[tuple[bytes, tuple[int, ...]]]) -> int:
        """Queue a copy to fresh host slots for each new chunk that fits (under _lock); the slots
        still wanted for those that did not (the host LRU makes room for later chunks)."""
        wanted = 0
        for k, b in new:
            h = self._held.get(k)
            if h is None or not b:
                continue
            slots = self._host.allocate(len(b))
            if slots is None:
                wanted += len(b)
                continue
            job = self._jobs.queue(k, b, slots)
            h.host, h.job_id = slots, job.job_id
            self.stats.offloads_queued += 1
        return wanted

    def take_offloads(self) -> list[OffloadJob]:
        """Queued offload jobs for this step's metadata, each handed out once (scheduler thread)."""
        with self._lock:
            self._apply_outcomes(self._jobs.expire())
            return self._jobs.take()

    def offload_output(self, worker_meta: Any) -> None:
        """A step's aggregated worker metadata (None: nothing reported): jobs done or failed."""
        with self._lock:
            self._apply_outcomes(self._jobs.answer(worker_meta) + self._jobs.expire())

    def has_pending_offloads(self) -> bool:
        """Offload jobs queued or sent and not ended: vLLM keeps stepping for them (each ends
        within OFFLOAD_ANSWER_BOUND_S of being sent)."""
        with self._lock:
            return not self._closing and self._jobs.pending()

    def _apply_outcomes(self, outcomes: list[JobOutcome]) -> None:
        for o in outcomes:
            h = self._held.get(o.key)
            live = h is not None and h.job_id == o.job.job_id
            if not o.why:
                self.stats.offloads_completed += 1
                self.stats.offload_s.append(o.seconds)
                if live:
                    assert h is not None
                    h.job_id, h.host_valid = 0, True
                    continue
            else:
                self.stats.offloads_failed += 1
                log.warning("pdxfer: host copy of chunk %s (job %d) failed: %s; it is unpublished as usual "
                            "when its retention ends", o.key.hex()[:16], o.job.job_id, o.why)
                if live:
                    assert h is not None
                    h.job_id, h.host = 0, None
            # Failed, or its chunk was let go meanwhile: the master never pointed at these slots.
            self._host.free(o.job.host_slots)

    def _mark_leaving(self, keys: Iterable[bytes], leaving: bool = True) -> None:
        """Mark (under _lock) the chunks an unpublish is about to take, or took: a re-publish or a
        retry that sees the mark leaves them out, one that does not ran before the mark and so
        took a sequence number the unpublish's fence covers."""
        for k in keys:
            h = self._held.get(k)
            if h is not None:
                h.leaving = leaving

    @staticmethod
    def _movable(h: _Held) -> bool:
        return h.host_valid and h.host is not None and not h.no_move and not h.moving

    def _mark_moving(self, keys: Iterable[bytes], retention_over: bool = False) -> dict[bytes, int]:
        """Of ``keys`` (held), those that move to their host copy now, with their refresh
        generation, marked moving (under _lock); ``retention_over``: the reaper's (a refused
        move is tried again shortly)."""
        moves: dict[bytes, int] = {}
        for k in keys:
            h = self._held.get(k)
            if h is not None and self._movable(h):
                h.moving = True
                if retention_over:
                    h.retain_until = time.monotonic() + min(1.0, self.cfg.lock_ttl_s)  # next try, if refused
                moves[k] = h.gen
        return moves

    def _submit_move(self, moves: dict[bytes, int]) -> None:
        try:
            self._publisher.submit(self._move, moves)
        except RuntimeError:  # closing
            with self._lock:
                for k in moves:
                    h = self._held.get(k)
                    if h is not None:
                        h.moving = False

    def _move(self, moves: dict[bytes, int]) -> list[bytes]:
        """Re-point the master's entries of ``moves`` (key -> refresh generation when decided) at
        their host copies, on the publisher thread (after every publish queued before); release
        the device blocks of each key the master accepted. Returns the moved keys. A key a
        reader's lock pins is refused by the master and tried again later; a key refreshed
        meanwhile keeps its device blocks too (a publish of them may follow the move)."""
        assert self.node_id is not None
        N = self._device_blocks
        with self._lock:
            entries = [(k, [N + s for s in h.host]) for k in moves
                       if (h := self._held.get(k)) is not None and h.host is not None]
        ok: set[bytes] = set()
        failed = False
        try:
            if entries:
                # Every device publish numbered so far is refused from now on, wherever it is (a
                # timed-out one may still land): none can re-point a moved key at freed blocks.
                self._hot.fence(self.node_id)
                # No hold-until: a host chunk is served until the host LRU evicts it (unpublish).
                accepted = self._hot.publish(self.node_id, entries, retention_s=None)
                if accepted >= len(entries):
                    ok = {k for k, _ in entries}
                elif accepted > 0:  # which ones: the same publish again, per key (idempotent)
                    ok = {k for k, b in entries if self._hot.publish(self.node_id, [(k, b)], retention_s=None) == 1}
        except PublishFenced as exc:  # a concurrent unpublish's fence: try again next round
            log.debug("pdxfer: host move fenced: %s", exc)
        except MasterError as exc:
            # Unknown outcome: the chunk takes the unpublish path, which copes with a lost master
            # (its host slots are freed once the key is confirmed gone).
            log.warning("pdxfer: moving %d chunks to the host tier failed (%s); unpublishing them instead",
                        len(entries), exc)
            failed = True
        moved: list[bytes] = []
        with self._lock:
            for k, gen in moves.items():
                h = self._held.get(k)
                if h is None:
                    continue
                h.moving = False
                if failed:
                    h.no_move, h.retain_until = True, 0.0
                    continue
                if k not in ok or h.gen != gen or h.host is None:
                    continue
                self._drop_held(k, h)
                self._host.add_host_only(k, h.host)
                self.stats.host_moves += 1
                moved.append(k)
            self._wake.notify()
        return moved

    def _free_host_only(self, key: bytes) -> bool:
        """The master confirmed ``key`` gone: its host slots are free (under _lock)."""
        slots = self._host.pop_host_only(key)
        if slots is None:
            return False
        self._host.free(slots)
        return True

    def _evict_host_async(self, want_slots: int) -> None:
        """Unpublish the least recently used host-only chunks in the background until about
        ``want_slots`` slots free; a slot is freed only after the master confirmed its key gone
        (one eviction at a time, on the publisher thread: after queued publishes and moves)."""
        with self._lock:
            if self._evicting or self.node_id is None:
                return
            keys: list[bytes] = []
            got = 0
            for k, slots in self._host.oldest():
                if got >= want_slots:
                    break
                keys.append(k)
                got += len(slots)
            if not keys:
                return
            self._evicting = True

        def run() -> None:
            try:
                gone = self._unpublish(self._hot, keys)
            except MasterError as exc:
                log.debug("pdxfer: host eviction failed: %s", exc)
                return
            finally:
                with self._lock:
                    self._evicting = False
            with self._lock:
                for k in gone:
                    if self._free_host_only(k):
                        self.stats.host_evictions += 1

        try:
            self._publisher.submit(run)
        except RuntimeError:  # closing
            with self._lock:
                self._evicting = False

    def _republish_host(self) -> None:
        """Publish the host-only chunks again (re-registration), on the publisher thread: an
        eviction (also there) cannot free a slot under this publish."""
        N = self._device_blocks
        with self._lock:
            entries = [(k, [N + s for s in slots]) for k, slots in self._host.oldest()]
        if not entries or self.node_id is None:
            return
        try:
            n = self._hot.publish(self.node_id, entries, retention_s=None)
            log.info("pdxfer: re-published %d/%d host chunks after re-registration", n, len(entries))
        except MasterError as exc:
            log.warning("pdxfer: re-publish of host chunks after re-registration failed: %s", exc)

    @property
    def host_chunks(self) -> int:
        with self._lock:
            return len(self._host)

    @property
    def host_slots_used(self) -> int:
        with self._lock:
            return self._host.used_count

    def _republish(self) -> None:
        """The master forgot us (restart, failover, lost lease): publish again what we hold, each
        chunk with the retention it has left (never longer: the master must stop serving an
        entry no later than this holder's deadline for it)."""

        if self.host_enabled:
            try:
                self._publisher.submit(self._republish_host)
            except RuntimeError:  # closing
                pass
        now = time.monotonic()
        groups: dict[int, list[tuple[bytes, list[int]]]] = {}
        if self.node_id is None:
            return
        with self._lock:
            # One sequence number for every group, taken with the snapshot: an unpublish (pressure
            # reclaim, host move) that takes a chunk after this fences the groups still unsent;
            # one that took it before marked it, and the snapshot leaves it out.
            seq = self._bg.next_publish_seq(self.node_id)
            for k, h in self._held.items():
                if h.retention_end:  # already past retention: must not be served again
                    continue
                if k in self._awaiting_fence:  # its own publish follows once the writes are confirmed
                    continue
                if h.leaving or h.moving:  # an unpublish or a host move is taking it
                    continue
                left = int(h.retain_until - now)  # rounded down to whole seconds: few calls
                # Only chunks the reaper cannot pick up while this publish may still be in flight.
                if left >= self.cfg.master_timeout_s + 1:
                    groups.setdefault(left, []).append((k, list(h.blocks)))
        if not groups:
            return
        n = total = 0
        try:
            for left, entries in sorted(groups.items()):
                total += len(entries)
                n += self._bg.publish(self.node_id, entries, retention_s=float(left), seq=seq)
            log.info("pdxfer: re-published %d/%d held chunks after re-registration", n, total)
        except PublishFenced:
            # An unpublish took some of these chunks meanwhile; the rest are published again by
            # their next refresh (or unpublished by the reaper as usual).
            log.info("pdxfer: re-publish after re-registration stopped at %d/%d chunks: an unpublish "
                     "fenced it", n, total)
        except MasterError as exc:
            log.warning("pdxfer: re-publish after re-registration failed: %s", exc)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.notify_all()
        if self._session is not None:
            try:
                self._session.stop(deregister=True)
            except Exception as exc:
                log.debug("pdxfer: node session stop: %s", exc)
        self._publisher.shutdown(wait=False, cancel_futures=True)
