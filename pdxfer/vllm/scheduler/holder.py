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

Parts that run apart, each in its own module: the cap (:mod:`pdxfer.vllm.scheduler.holder_cap`),
the reaper (:mod:`pdxfer.vllm.scheduler.holder_reaper`) and the host tier
(:mod:`pdxfer.vllm.scheduler.holder_host_tier`: held chunks' copies in host memory).
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

from pdxfer.kv.groups import KVGroups, held_blocks
from pdxfer.kv.keys import IncrementalHasher, state_key
from pdxfer.master import MasterError, MasterUnavailable, NodeInfo, NodeSession, PublishFenced
from pdxfer.kv.chunks import chunk_span
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.vllm.faults.hooks import test_hook_float
from pdxfer.vllm.scheduler.block_pool import BlockPoolHolder
from pdxfer.vllm.metadata import OffloadJob
from pdxfer.vllm.scheduler.holder_cap import HeldCap
from pdxfer.vllm.scheduler.holder_host_tier import HostTier
from pdxfer.vllm.scheduler.holder_reaper import Reaper
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


class HolderPath:
    def __init__(self, cfg: ConnectorConfig, *, block_size: int, hot: Any, bg: Any,
                 stats: SchedulerStats, fence: WriteFence | None = None, tp_size: int = 1,
                 kv_groups: KVGroups | None = None) -> None:
        self.cfg = cfg
        # A hybrid model's chunk entries name every group's blocks (pdxfer.kv.groups).
        self.kv_groups = kv_groups or KVGroups.plain()
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
        self._reaper = Reaper(self)
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="pdxfer-publish")  # keeps order
        self._superseded = False
        self.cap = HeldCap(self)  # keeps held blocks under held_blocks_cap
        self.stale_after_s_override: float | None = None  # tests shorten the last-resort bound
        self.host_tier = HostTier(self, tp_size)  # guarded by _lock too

    def bind_block_pool(self, pool: Any) -> None:
        self._pool = pool if isinstance(pool, BlockPoolHolder) else BlockPoolHolder(pool)

    def set_host_tier(self, num_slots: int, device_blocks: int) -> None:
        """Every TP rank has ``num_slots`` host slots; the device KV cache has ``device_blocks``
        blocks (host slot s is block id ``device_blocks + s`` at the master). 0 slots: no tier."""
        self.host_tier.set_up(num_slots, device_blocks)

    @property
    def host_enabled(self) -> bool:
        return self.host_tier.enabled

    def start(self, info: NodeInfo) -> None:
        """Register the node under a lease and start the reaper."""
        self.node_id = info.node_id
        self._session = NodeSession(self._bg, info, lease_ttl_s=self.cfg.lease_ttl_s,
                                    on_reregistered=self._republish, on_superseded=self._on_superseded)
        self._session.start()
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
        self.host_tier.drop_host_only()  # the master dropped our host entries too

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
                         new_hasher: Callable[[], IncrementalHasher], write_seq: int = 0,
                         group_block_ids: Sequence[Sequence[int]] | None = None,
                         state_final: bool = False) -> int:
        """Publish every full chunk of a finished request and hold its blocks. ``tokens``: the
        tokens whose KV is in ``block_ids`` (None: nothing publishable, e.g. aborted);
        ``group_block_ids``: a hybrid model's block table per KV cache group (``block_ids`` is
        then ignored; a sliding window's freed blocks are vLLM's null block);
        ``hasher``: the request's own, if the reader path made one; ``new_hasher()`` makes one;
        ``write_seq``: the step whose completion on the device the publish waits for (0: none);
        ``state_final``: the request computed exactly ``tokens`` and its recurrent groups' state
        blocks hold the state after them (only then does the entry ending there name them).
        Returns how many leading tokens the queued publish covers (0: none), the decode's hint."""
        try:
            self.drain_frees()
            if tokens is None or self._pool is None or self.node_id is None:
                return 0
            C = self.cfg.chunk_tokens
            tables = tuple(group_block_ids) if group_block_ids is not None else (block_ids,)
            chunk_blocks: list[tuple[int, ...]] = []
            for i in range(min(len(tokens), min(map(len, tables)) * self.block_size) // C):
                blocks = self._chunk_blocks(i, tables)
                if blocks is None:
                    break
                chunk_blocks.append(blocks)
            n_chunks = len(chunk_blocks)
            tail_blocks = self._tail_blocks(len(tokens), n_chunks, tables)
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
            if state_final and self.kv_groups.has_state and keys:
                self._add_state_entry(keys, chunk_blocks, len(tokens), n_chunks, tables)
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

    def _add_state_entry(self, keys: list[bytes], chunk_blocks: list[tuple[int, ...]], n_tokens: int,
                         n_chunks: int, tables: Sequence[Sequence[int]]) -> None:
        """Append the last entry again, with the recurrent groups' state, under its state key.

        The plain entry stays: its key may already be held without state (an earlier request
        computed past this point, where the state after it was never kept), and one key has one
        entry per holder. A reader of a recurrent model asks for the state key at its hit's end."""
        if len(keys) > n_chunks:
            entry = self._tail_blocks(n_tokens, n_chunks, tables, state_final=True)
        elif n_chunks * self.cfg.chunk_tokens == n_tokens:
            entry = self._chunk_blocks(n_chunks - 1, tables, state_final=True)
        else:
            return
        if entry is not None and entry != chunk_blocks[-1]:
            keys.append(state_key(keys[-1]))
            chunk_blocks.append(entry)

    def _tail_blocks(self, n_tokens: int, n_chunks: int, tables: Sequence[Sequence[int]],
                     state_final: bool = False) -> tuple[int, ...] | None:
        """Blocks of the tokens after the last full chunk, when they are the whole rest of the
        request, else None. With blocks larger than a chunk that is the one block holding them,
        which may hold earlier chunks too (a reader takes it as the source of all its tokens up to
        the prompt's end: they are this very prompt's)."""
        C, bs = self.cfg.chunk_tokens, self.block_size
        start = n_chunks * C
        if n_tokens <= start or n_tokens - start >= C:
            return None
        end_block = -(-n_tokens // bs)
        return self.kv_groups.entry(tables, start // bs, end_block - start // bs, self._null_block(), state_final)

    def _chunk_blocks(self, chunk: int, tables: Sequence[Sequence[int]],
                      state_final: bool = False) -> tuple[int, ...] | None:
        span = chunk_span(chunk, self.cfg.chunk_tokens, self.block_size)
        return self.kv_groups.entry(tables, span.first_block, span.num_blocks, self._null_block(), state_final)

    def _null_block(self) -> int | None:
        """The id vLLM gives freed sliding-window blocks (only a hybrid model's tables hold it)."""
        return self._pool.null_block_id if self.kv_groups.hybrid and self._pool is not None else None

    def _publish(self, keys: list[bytes], blocks: list[tuple[int, ...]], req_id: str = "",
                 write_seq: int = 0) -> int:
        """Hold and queue the publish of ``keys``; how many leading keys it covers (the cap may
        let only a prefix of the new ones through), 0 when nothing was queued."""
        assert self._pool is not None and self.node_id is not None
        if self._superseded:
            return 0
        now = time.monotonic()
        retain = test_hook_float("retention_s") or self.cfg.retention_s
        host_ok = self.host_tier.usable()
        with self._lock:
            # Host-only chunks are served from their host copy: refreshed in the host LRU, never
            # published from the device too (one location per key and node at the master).
            on_host = {k for k in keys if k not in self._held and self.host_tier.slots.touch(k)}
            new = [(k, b) for k, b in zip(keys, blocks) if k not in self._held and k not in on_host]
        if new:
            new = self.cap.fit(new)  # may reclaim (free) old chunks: before the refresh
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
            self._pool.hold(held_blocks(b))
        # Bookkeeping first: from here on the reaper owns these chunks whatever the master says.
        with self._lock:
            if write_seq > 0 and self._fence is not None:
                self._awaiting_fence.update(k for k, _ in new)
            for k, b in new:
                self._held[k] = _Held(b, now + retain, last_seq=seq)
                for x in held_blocks(b):
                    self._held_block_refs[x] = self._held_block_refs.get(x, 0) + 1
            host_wanted = self.host_tier.queue_offloads(new) if host_ok else 0
            self._wake.notify()
        if host_wanted:
            self.host_tier.evict_async(host_wanted)
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
                    self.host_tier.slots.free(h.host)

    def _drop_held(self, key: bytes, h: _Held) -> None:
        """Stop holding ``key``'s device blocks: queued for release on the scheduler thread (under _lock)."""
        del self._held[key]
        for x in held_blocks(h.blocks):
            n = self._held_block_refs.get(x, 0) - 1
            if n <= 0:
                self._held_block_refs.pop(x, None)
            else:
                self._held_block_refs[x] = n
        self._to_free.append(held_blocks(h.blocks))
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

    def _unpublish(self, client: Any, keys: list[bytes]) -> list[bytes]:
        """Keys the master no longer serves for us, after fencing every publish queued so far: a
        publish that timed out here, or still waits in a queue or a socket, can never land after
        we free the blocks it names."""
        assert self.node_id is not None
        return client.unpublish_if_unlocked(self.node_id, keys,
                                            fence_seq=client.last_publish_seq(self.node_id))

    def _mark_leaving(self, keys: Iterable[bytes], leaving: bool = True) -> None:
        """Mark (under _lock) the chunks an unpublish is about to take, or took: a re-publish or a
        retry that sees the mark leaves them out, one that does not ran before the mark and so
        took a sequence number the unpublish's fence covers."""
        for k in keys:
            h = self._held.get(k)
            if h is not None:
                h.leaving = leaving

    # ------------------------------------------------------------------ host tier (holder_host_tier)

    def take_offloads(self) -> list[OffloadJob]:
        """Queued offload jobs for this step's metadata, each handed out once (scheduler thread)."""
        return self.host_tier.take_offloads()

    def offload_output(self, worker_meta: Any) -> None:
        """A step's aggregated worker metadata (None: nothing reported): jobs done or failed."""
        self.host_tier.offload_output(worker_meta)

    def has_pending_offloads(self) -> bool:
        """Offload jobs queued or sent and not ended: vLLM keeps stepping for them."""
        return self.host_tier.has_pending_offloads()

    @property
    def host_chunks(self) -> int:
        return self.host_tier.chunks

    @property
    def host_slots_used(self) -> int:
        return self.host_tier.slots_used

    def _republish(self) -> None:
        """The master forgot us (restart, failover, lost lease): publish again what we hold, each
        chunk with the retention it has left (never longer: the master must stop serving an
        entry no later than this holder's deadline for it)."""

        if self.host_enabled:
            try:
                self._publisher.submit(self.host_tier.republish)
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
