"""The reader (consumer) path of the scheduler half: look up and lock a prompt's chunks, plan the
load into the blocks vLLM allocated, hand load specs to the worker half.

Runs on vLLM's scheduler thread; only unused locks are given back on a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pdxfer.common.bounded_cache import ClearWhenFullCache
from pdxfer.kv.groups import GroupError, KVGroups
from pdxfer.kv.keys import IncrementalHasher, state_key
from pdxfer.kv.layout import KVLayout, LayoutError
from pdxfer.master import MasterError
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.vllm.faults.hooks import test_hook_float, test_hooks_on
from pdxfer.vllm.scheduler.hint_wait import HintPoller, HintWait
from pdxfer.vllm.holder_routes import NotReadable, holder_route_key, holder_total_heads, layouts_of, routes
from pdxfer.vllm.load_plan import HitShape, exact_end, plan_reads
from pdxfer.vllm.lock_release import release_off_path
from pdxfer.vllm.metadata import HolderRef, LoadSpec, PdxferConnectorMetadata, RepullSpec
from pdxfer.vllm.scheduler.reader_benefit import LoadGate
from pdxfer.vllm.scheduler.reader_groups import (blocks_in_range, check_group_holder, check_state_bytes, group_hit,
                                                 groups_end, plan_group_reads)
from pdxfer.vllm.scheduler.scheduler_state import EpisodeLog, SchedulerStats

log = logging.getLogger("pdxfer.vllm.scheduler")


@dataclass
class _Lookup:
    lock_id: str
    local_tokens: int  # tokens vLLM already had locally when we looked up
    first_chunk: int  # chunk index of locations[0]
    hit_end: int  # tokens [0, hit_end) are available locally + remotely
    locations: list[Any]
    nodes: dict[str, Any]
    expires_at: float  # wall clock
    tail_tokens: int = 0  # > 0: the last location is the prompt's partial last chunk
    looked_up_at: float = 0.0  # wall clock of the lookup's answer (the worker times the gap to its post)
    epochs: dict[str, int] | None = None  # each holder's registration, as the lookup named it
    skip: dict[str, int] | None = None  # what the lookup ruled out (a worker's re-pull rules it out too)


# Between lookups of a request waiting for a hinted publish (on the poller's thread; a master
# round trip here is ~0.3 ms).
_HINT_RETRY_S = 0.002
# Unusable registrations a lookup names at most (holders come and go over a long life).
_MAX_SKIP = 256


class ReaderPath:
    def __init__(self, cfg: ConnectorConfig, *, block_size: int, tp_size: int, total_kv_heads: int,
                 reader_id: str, hot: Any, bg: Any, stats: SchedulerStats,
                 hasher: Callable[[str, str | None], IncrementalHasher],
                 own_node: Callable[[], str | None], kv_groups: KVGroups | None = None) -> None:
        self.cfg = cfg
        self.kv_groups = kv_groups or KVGroups.plain()
        self.null_block = 0  # vLLM's null block id (set from the block pool when bound)
        self.block_size = block_size
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        # This engine's KV layout per TP rank, from the workers' handshakes; until they arrive
        # no holder is usable (vLLM hands them over before it schedules anything).
        self._local: dict[int, KVLayout] = {}
        # Per holder (node id + what it announced): usable or not, decided once; a refusal is
        # logged once per holder and reason, naming both sides. Holders come and go over a long
        # life, so past 1024 of them the memo starts over rather than grow.
        self._usable: ClearWhenFullCache[tuple[str, str], bool] = ClearWhenFullCache(1024)
        # Registrations (node id -> epoch) found unusable: every lookup names them, so the master
        # never lets one hide a holder with the same chunks that this reader can read.
        self._unusable_regs: dict[str, int] = {}
        self._skip_mu = threading.Lock()  # the hint poller's thread learns holders too
        self.reader_id = reader_id
        self._hot = hot  # lookups: the short bound of the scheduler's hot path
        self._bg = bg
        self.stats = stats
        # Load or recompute by measured benefit (None: every usable hit is loaded). With test
        # hooks on it measures from the start and decides while hook file ``load_benefit`` says
        # so (_active_gate): one running pair tests the gate and the plain path.
        self.gate = LoadGate(cfg.load_benefit_margin, stats) if cfg.load_benefit or test_hooks_on() else None
        self._hasher = hasher
        self._own_node = own_node
        self._lookups: dict[str, _Lookup] = {}
        # Requests waiting for a hinted publish: looked up on the poller's thread, never here.
        self._hint_waits = HintPoller(self._poll_lookup, self._release_async, _HINT_RETRY_S)
        self._pending_loads: list[LoadSpec] = []
        # This step's holder descriptions by the lookup's NodeInfo object (kept alive with it, so
        # its id is not reused): loads naming the same description share one object, which vLLM's
        # pickling of the metadata then sends once.
        self._step_refs: dict[int, tuple[Any, HolderRef]] = {}
        # One remote load per request: after a failed load (or a preemption) vLLM asks again,
        # and a fault that persists must not turn into a load-fail-recompute loop.
        self._attempted: set[str] = set()
        self._lookup_log = EpisodeLog("master lookups")
        self._backoff_until = 0.0
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="pdxfer-release")

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(self, req_id: str, tokens: Sequence[int], num_tokens: int,
                                   num_computed_tokens: int, cache_salt: str | None,
                                   hinted_tokens: int = 0) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be read from holders, or None while
        chunks a prefill said it published (``hinted_tokens``) are not at the master yet and
        vLLM should ask again next step; never raises."""
        try:
            return self._match(req_id, tokens, num_tokens, num_computed_tokens, cache_salt, hinted_tokens)
        except Exception as exc:  # never an exception into vLLM's scheduler
            log.exception("pdxfer: lookup for %s failed unexpectedly: %s", req_id, exc)
            self.drop_lookup(req_id)
            self._hint_waits.cancel(req_id)
            return 0, False

    def _match(self, req_id: str, tokens: Sequence[int], num_tokens: int, local: int,
               cache_salt: str | None, hinted: int = 0) -> tuple[int | None, bool]:
        C = self.cfg.chunk_tokens
        if req_id in self._attempted:
            return 0, False
        waited: HintWait | None = None
        if req_id in self._hint_waits:
            waited = self._hint_waits.take_if_over(req_id, time.monotonic())
            if waited is None:
                return None, False  # still waiting: the poller asks the master, not this thread
            if waited.context != local:
                # vLLM's local prefix changed meanwhile: that answer does not fit; no second wait.
                self._end_wait(req_id, waited, hinted)
                if waited.result is not None and waited.result.lock_id is not None:
                    self._release_async(waited.result.lock_id)
                waited, hinted = None, 0
        prev = self._lookups.get(req_id)
        if prev is not None:
            # vLLM asks again when it could not schedule the request: reuse a lock with time left.
            if prev.local_tokens == local and prev.expires_at - time.time() > self.cfg.lookup_timeout_s + 0.5:
                return max(prev.hit_end - local, 0), prev.hit_end > local
            self.drop_lookup(req_id)
        # At least one token must be computed here (vLLM samples from it): never the whole prompt.
        last = num_tokens - 1
        first = local // C
        if last <= local:
            return 0, False
        now_mono = time.monotonic()
        if waited is None and now_mono < self._backoff_until:
            return 0, False
        hasher = self._hasher(req_id, cache_salt)
        # A recurrent group's state must be the state after exactly the hit: a prefill stops one
        # token short for it (the prefill-step truncation), so the lookup names that prompt.
        span = last if self.kv_groups.has_state else num_tokens
        prompt = list(tokens[:span])
        keys = hasher.update(prompt)  # every full chunk of the prompt
        # The partial last chunk too: the prefill that computed this very prompt published it.
        tail = hasher.tail(prompt)
        want = keys[first:] + ([tail] if tail is not None else [])
        if not want:
            return 0, False
        if self.kv_groups.has_state:
            want[-1] = state_key(want[-1])  # the entry that also names the state after the hit
        if waited is not None:
            self._end_wait(req_id, waited, hinted)
            res, answered_at = waited.result, waited.answered_at
            if res is None:
                return 0, False
        else:
            ttl = test_hook_float("lock_ttl_s") or self.cfg.lock_ttl_s
            self.stats.lookups += 1
            t0 = time.monotonic()
            try:
                # Every TP rank of this engine reads its heads under this lock and releases it.
                res = self._lookup_readable(want, ttl)
            except MasterError as exc:
                self.stats.master_errors += 1
                self._lookup_log.fail(exc)
                self._backoff_until = now_mono + 1.0  # a dead master must not cost every request a timeout
                return 0, False
            self._lookup_log.ok()
            answered_at = time.time()
            self.stats.phases.add("lookup", time.monotonic() - t0)
            expected = self._hinted_keys(hinted, first, len(keys), tail is not None and hinted == span)
            if res.hit_chunks < expected and self.cfg.publish_hint_wait_s > 0:
                # Announced chunks are not there yet: wait for them off this thread, bounded by
                # publish_hint_wait_s from this miss; this answer (and its lock) is the fallback.
                now = time.monotonic()
                self._hint_waits.start(req_id, HintWait(want, expected, now, now + self.cfg.publish_hint_wait_s,
                                                        local, res, answered_at))
                self.stats.publish_hint_waits += 1
                return None, False
        # The hit funnel (exists -> visible -> selected; loaded is the workers' count): where a
        # prompt's held tokens stop counting says why this request did not hit.
        visible_end = (first + min(res.hit_chunks, len(keys) - first)) * C
        if tail is not None and res.hit_chunks == len(want):
            visible_end = span
        exists_end = max(visible_end, min(hinted, span))
        if res.hit_chunks == 0 or res.lock_id is None:
            self._count_funnel(req_id, local, last, exists_end, visible_end, local)
            return 0, False
        lk = _Lookup(res.lock_id, local, first, 0, list(res.locations), dict(res.nodes),
                     answered_at + res.lock_ttl_s, looked_up_at=answered_at, epochs=dict(res.epochs or {}),
                     skip=self._skip())
        usable = self._usable_chunks(lk)
        pieces = None
        gate = self._active_gate()
        if gate is not None and usable:
            tail_n = span - len(keys) * C if tail is not None else 0
            pieces = gate.pieces(lk.locations[:usable], lk.nodes, local, first, C, tail_n, len(keys), last)
            usable = gate.decide(req_id, pieces).chunks
            if usable == 0:
                self._count_funnel(req_id, local, last, exists_end, visible_end, local)
                self._release_async(res.lock_id)
                return 0, False
        hit_end = (first + min(usable, len(keys) - first)) * C
        if tail is not None and usable == len(want):
            lk.tail_tokens = span - len(keys) * C
            hit_end = span
        if hit_end >= last:
            hit_end = last  # the last block is read whole; the last token is computed here
        else:
            hit_end -= hit_end % self.block_size  # only whole local blocks can be filled
        lk.locations = lk.locations[:usable]
        hit_end = self._exact_end(lk, local, hit_end)
        if self.kv_groups.hybrid and hit_end > local:
            hit_end = self._groups_end(lk, local, hit_end)
        self._count_funnel(req_id, local, last, exists_end, visible_end, max(hit_end, local))
        if hit_end <= local:
            self._release_async(res.lock_id)
            return 0, False
        lk.hit_end = hit_end
        self._lookups[req_id] = lk
        if pieces is not None:
            assert self.gate is not None
            self.gate.planned(req_id, pieces[:usable])
        return hit_end - local, True

    def _count_funnel(self, req_id: str, local: int, last: int, exists_end: int, visible_end: int,
                      selected_end: int) -> None:
        """One request's hit funnel, in tokens beyond its local prefix and short of its last
        token (always computed here): published as far as this reader can know (its prefill's
        hint, or the master's answer), visible in the master's answer, selected to load."""
        exists, visible, selected = (max(min(e, last) - local, 0) for e in (exists_end, visible_end, selected_end))
        self.stats.hit_exists_tokens += exists
        self.stats.hit_visible_tokens += visible
        self.stats.lookup_hit_tokens += selected
        log.debug("pdxfer: %s: hit funnel: %d tokens published, %d visible at the master, %d selected to "
                  "load (%d local of %d)", req_id, exists, visible, selected, local, last + 1)

    def _hinted_keys(self, hinted: int, first: int, n_full: int, tail_hinted: bool) -> int:
        """Keys of a lookup (full chunks from ``first``, then the tail) that the hint covers.
        ``tail_hinted``: the hint covers this very prompt, so its tail key was published too."""
        if hinted <= 0:
            return 0
        return max(min(hinted // self.cfg.chunk_tokens, n_full) - first, 0) + (1 if tail_hinted else 0)

    def _end_wait(self, req_id: str, w: HintWait, hinted: int) -> None:
        self.stats.lookups += w.lookups
        self.stats.master_errors += w.errors
        self.stats.phases.add("publish_wait", time.monotonic() - w.since)
        if not w.done:
            self.stats.publish_hint_timeouts += 1
            got = w.result.hit_chunks if w.result is not None else 0
            log.warning("pdxfer: %s: the prefill published %d tokens but after %.0f ms the master "
                        "has %d of %d chunks; going on without the rest", req_id, hinted,
                        self.cfg.publish_hint_wait_s * 1e3, got, w.expected)

    def _poll_lookup(self, want: list[bytes]) -> Any:
        """One lookup of a waiting request (on the poller's thread)."""
        return self._lookup_readable(want, test_hook_float("lock_ttl_s") or self.cfg.lock_ttl_s)

    def _lookup_readable(self, want: list[bytes], ttl: float) -> Any:
        """A lookup that names the holders this reader cannot use (itself, registrations judged
        unusable, other transports), so the master chooses among the others. An answer that
        still names a holder not judged before (now marked) is asked once more: one retry."""
        res = None
        gate = self._active_gate()
        for attempt in range(2):
            res = self._hot.lookup_and_lock(want, self.reader_id, lock_ttl_s=ttl, parties=self.tp_size,
                                            skip=self._skip(), transport=self.cfg.transport,
                                            prefer_tier=gate.preferred_tier if gate is not None else None)
            if attempt or res.lock_id is None or not self._learn_unusable(res):
                return res
            self._release_async(res.lock_id)
        return res

    def _active_gate(self) -> LoadGate | None:
        """The load gate while it decides: always with ``load_benefit``, else (tests) while the
        ``load_benefit`` hook file holds a positive number."""
        if self.gate is None or self.cfg.load_benefit:
            return self.gate
        return self.gate if test_hook_float("load_benefit") else None

    def _skip(self) -> dict[str, int]:
        with self._skip_mu:
            skip = dict(self._unusable_regs)
        own = self._own_node()
        if own is not None:
            skip[own] = 0  # every registration of this instance: its own KV is local already
        return skip

    def _learn_unusable(self, res: Any) -> bool:
        """Mark the holders of ``res`` this reader cannot use; True when one was not marked yet."""
        if not self._local:
            return False  # nothing is usable before the workers' layouts arrive: judge nothing yet
        own = self._own_node()
        new = False
        for nid, node in res.nodes.items():
            epoch = res.epochs.get(nid)
            if nid == own:
                new = True  # skipped from the next lookup on (own is known now)
            elif epoch is not None and not self._holder_usable(node):
                with self._skip_mu:
                    if self._unusable_regs.get(nid) != epoch:
                        if len(self._unusable_regs) >= _MAX_SKIP:  # bounded: forget the oldest
                            del self._unusable_regs[next(iter(self._unusable_regs))]
                        self._unusable_regs[nid] = epoch
                        new = True
        return new

    def set_local_layouts(self, layouts: dict[int, KVLayout]) -> None:
        self._local = dict(layouts)
        if self.gate is not None:
            self.gate.set_bytes_per_token(self._local.values(), self.block_size)
        self._usable.clear()
        with self._skip_mu:
            self._unusable_regs.clear()

    def _usable_chunks(self, lk: _Lookup) -> int:
        """Leading hit chunks this reader can load: from holders every rank of this engine can
        read (directly or converting), not from itself."""
        n = 0
        own = self._own_node()
        for loc in lk.locations:
            node = lk.nodes.get(loc.node_id)
            if node is None or loc.node_id == own or not self._holder_usable(node):
                break
            n += 1
        return n

    def _groups_end(self, lk: _Lookup, local: int, hit_end: int) -> int:
        """A hybrid hit cut to where every KV cache group is served (the locations too)."""
        try:
            hit = group_hit(self.kv_groups, lk.locations, lk.first_chunk, self.cfg.chunk_tokens, self.block_size,
                            lk.tail_tokens)
            end, kept, tail = groups_end(hit, local, hit_end)
        except GroupError as exc:
            log.warning("pdxfer: a hit's KV cache groups do not fit this reader (%s); computing here", exc)
            return local
        if end < hit_end:
            self.stats.hybrid_hits_cut += 1
            log.debug("pdxfer: hit cut from %d to %d tokens: a sliding window's or a recurrent state's blocks are "
                      "not held", hit_end, end)
        lk.locations, lk.tail_tokens = lk.locations[:kept], tail
        return end

    def _holder_usable(self, node: Any) -> bool:
        key = holder_route_key(node, lambda e: e.layout_fingerprint)
        return self._usable.get_or_make(key, lambda: self._check_holder(node))

    def _check_holder(self, node: Any) -> bool:
        """Can every rank of this engine read its heads from ``node``? Logged once when not."""
        if not self._local:
            return False
        try:
            if node.transport != self.cfg.transport:
                raise NotReadable(f"holder {node.node_id} serves over {node.transport}, this reader uses "
                                  f"{self.cfg.transport}")
            if self.kv_groups.hybrid:
                check_group_holder(node, self.kv_groups, self.block_size, self.tp_size)
            layouts = layouts_of(node.endpoints)
            if self.kv_groups.has_state:
                check_state_bytes(node.node_id, layouts, self._local)
            total = holder_total_heads(int(node.total_kv_heads or 0), len(layouts), layouts[0])
            for rank, local in sorted(self._local.items()):
                routes(node.node_id, layouts, total, local, self.tp_size, rank, self.total_kv_heads,
                       staging=self.cfg.staging_enabled, chunk_tokens=self.cfg.chunk_tokens)
            return True
        except NotReadable as exc:
            log.warning("pdxfer: not reading from holder %s: %s; its chunks are computed here", node.node_id, exc)
            return False

    # ------------------------------------------------------------------ plan

    def update_state_after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 group_block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Plan the load of a request vLLM allocated blocks for; ``group_block_ids``: a hybrid
        model's block table per KV cache group (``block_ids`` is group 0's)."""
        lk = self._lookups.pop(req_id, None)
        hybrid = self.kv_groups.hybrid and group_block_ids is not None
        if lk is None:
            if num_external_tokens > 0:
                # vLLM waits for a load we never offered: fail it (all blocks) rather than hang.
                log.error("pdxfer: %s: %d external tokens without a lookup; recomputing", req_id,
                          num_external_tokens)
                tables = group_block_ids if hybrid else (block_ids,)
                self._attempted.add(req_id)
                self._pending_loads.append(LoadSpec(req_id, "", num_external_tokens, (), 0.0, tuple(
                    int(b) for t in tables for b in t if not hybrid or int(b) != self.null_block)))
            return
        if num_external_tokens <= 0:
            self._release_async(lk.lock_id)
            return
        if hybrid:
            assert group_block_ids is not None
            self._plan_hybrid(req_id, lk, group_block_ids, num_external_tokens)
            return
        bs = self.block_size
        start = lk.hit_end - num_external_tokens
        covered = tuple(int(b) for b in block_ids[max(start, 0) // bs: -(-lk.hit_end // bs)])
        repull = None
        try:
            reads = plan_reads(self._shape(lk), bs, start, lk.hit_end, block_ids)
            holders = tuple(self._ref(lk.nodes[n], (lk.epochs or {}).get(n, 0))
                            for n in sorted({r.node_id for r in reads}))
            repull = RepullSpec(self.reader_id, tuple(loc.key for loc in lk.locations), lk.first_chunk,
                                lk.tail_tokens, self.cfg.chunk_tokens, start, lk.hit_end,
                                tuple(int(b) for b in block_ids[: -(-lk.hit_end // bs)]),
                                tuple(sorted((lk.skip or {}).items())),
                                test_hook_float("lock_ttl_s") or self.cfg.lock_ttl_s)
        except Exception as exc:
            # vLLM already counts these tokens as coming: a load with no reads fails -> recompute.
            log.warning("pdxfer: cannot plan load for %s (%s); it will be recomputed", req_id, exc)
            reads, holders = (), ()
        self._attempted.add(req_id)
        self._pending_loads.append(LoadSpec(req_id, lk.lock_id, num_external_tokens, reads, lk.expires_at,
                                            covered, looked_up_at=lk.looked_up_at, holders=holders,
                                            repull=repull))

    def _plan_hybrid(self, req_id: str, lk: _Lookup, tables: Sequence[Sequence[int]],
                     num_external_tokens: int) -> None:
        """A hybrid model's load: every group's blocks, block for block; no re-pull."""
        start = lk.hit_end - num_external_tokens
        covered = blocks_in_range(tables, start, lk.hit_end, self.block_size, self.null_block)
        try:
            hit = group_hit(self.kv_groups, lk.locations, lk.first_chunk, self.cfg.chunk_tokens, self.block_size,
                            lk.tail_tokens)
            reads, filled = plan_group_reads(hit, start, lk.hit_end, tables, self.null_block)
            n_filled = {b for _, blocks in filled for b in blocks}
            if n_filled != set(covered):
                raise GroupError(f"the reads fill {len(n_filled)} blocks, vLLM allocated {len(set(covered))} for "
                                 "the loaded tokens")
            holders = tuple(self._ref(lk.nodes[n], (lk.epochs or {}).get(n, 0))
                            for n in sorted({r.node_id for r in reads}))
        except Exception as exc:
            log.warning("pdxfer: cannot plan load for %s (%s); it will be recomputed", req_id, exc)
            reads, holders, filled = (), (), ()
        self._attempted.add(req_id)
        self._pending_loads.append(LoadSpec(req_id, lk.lock_id, num_external_tokens, reads, lk.expires_at,
                                            covered, looked_up_at=lk.looked_up_at, holders=holders,
                                            groups=filled))

    def _ref(self, node: Any, epoch: int = 0) -> HolderRef:
        """The worker's description of holder ``node``, exactly as this lookup returned it."""
        got = self._step_refs.get(id(node))
        if got is None or got[0] is not node or got[1].epoch != epoch:
            got = self._step_refs[id(node)] = (node, HolderRef.of(node, epoch))
        return got[1]

    def _shape(self, lk: _Lookup) -> HitShape:
        return HitShape(lk.first_chunk, tuple((loc.node_id, tuple(loc.block_ids)) for loc in lk.locations),
                        {n: int(lk.nodes[n].layout["block_size"]) for n in {loc.node_id for loc in lk.locations}},
                        self.cfg.chunk_tokens, lk.tail_tokens)

    def _exact_end(self, lk: _Lookup, local: int, hit_end: int) -> int:
        """``hit_end``, or less where holders of other block sizes cannot serve the tokens up to
        it exactly (the rest is computed here rather than loaded wrong)."""
        shape = self._shape(lk)
        if hit_end <= local or shape.same_block_size(self.block_size):
            return hit_end
        try:
            end = exact_end(shape, self.block_size, local, hit_end)
        except LayoutError as exc:
            log.warning("pdxfer: holders' blocks do not fit their chunks (%s); computing here", exc)
            return local
        if end < hit_end:
            log.debug("pdxfer: hit cut from %d to %d tokens: no exact read into blocks of %d", hit_end, end,
                      self.block_size)
        return end

    def take_metadata(self, scheduled_tokens: dict[str, int] | None = None) -> PdxferConnectorMetadata:
        """The loads planned since the last step, for this step's metadata; ``scheduled_tokens``
        (vLLM's tokens per request of this step) feeds the load gate's prefill rate."""
        if self.gate is not None:
            self.gate.step_built(scheduled_tokens, (spec.req_id for spec in self._pending_loads))
        meta = PdxferConnectorMetadata(loads=self._pending_loads)
        self._pending_loads, self._step_refs = [], {}
        return meta

    # ------------------------------------------------------------------ locks we will not use

    def finish_request(self, req_id: str) -> None:
        self.drop_lookup(req_id)
        if self.gate is not None:
            self.gate.dropped(req_id)
        self._attempted.discard(req_id)
        self._hint_waits.cancel(req_id)

    def step_output(self, finished_recving: Any) -> None:
        """vLLM's output of a step: the loads it reports finished (for the load gate)."""
        if self.gate is not None:
            self.gate.step_output(finished_recving)

    def drop_lookup(self, req_id: str) -> None:
        lk = self._lookups.pop(req_id, None)
        if lk is not None:
            self._release_async(lk.lock_id)

    def _release_async(self, lock_id: str) -> None:
        """A lock we will not use: give it back off the hot path (it expires anyway)."""
        release_off_path(self._releaser, self._bg.release, lock_id, all_parties=True)

    def close(self) -> None:
        self._hint_waits.close()  # gives its locks back through the releaser: first
        self._releaser.shutdown(wait=False, cancel_futures=True)
