"""Worker half of the pdxfer connector: register KV once, post reads, validate, report.

Each load is a :class:`pdxfer.vllm.worker.load.Load` moving through its phases; its reads are
:mod:`pdxfer.vllm.worker.reads`, its holder connections :mod:`pdxfer.vllm.worker.peers`.

Runs in vLLM's worker process. Reads are posted when the step's metadata arrives and checked
(never waited on) at the end of each step; a finished read is only reported as loaded after
the master confirmed, at ``release``, that the lock held for the whole read. Anything else -- a
failed or timed-out read, a vanished holder, an expired lock, an unreachable master -- reports
the request's blocks as load errors, and vLLM recomputes them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Mapping

from pdxfer.contracts.connector_config import ConnectorConfig, check_reachable
from pdxfer.kv.groups import LAYOUT_KEY as GROUPS_LAYOUT_KEY
from pdxfer.kv.groups import KVGroups
from pdxfer.kv.layout import KVLayout, Region, describe_kv_caches
from pdxfer.kv.tiers import HOST_LAYOUT_KEY
from pdxfer.transport import create_transport, transport_options
from pdxfer.transport.base import PeerDied, PeerUnreachable, RegisteredRegion
from pdxfer.vllm.faults.hooks import test_hook_float
from pdxfer.vllm.faults.load_corruption import maybe_corrupt_load
from pdxfer.vllm.lock_release import release_off_path
from pdxfer.vllm.metadata import HolderRef, LoadSpec, PdxferConnectorMetadata, PdxferHandshake, PdxferWorkerMeta
from pdxfer.vllm.worker import repull as rp_plan
from pdxfer.vllm.worker.host_pool import AUTO_HOST_SHARE, HostPool, auto_host_tier_mib, host_slots_for
from pdxfer.vllm.worker.load import NOT_POSTED, Load, LoadPhase
from pdxfer.vllm.worker.peers import HolderPeers
from pdxfer.vllm.worker.reads import LoadReads
from pdxfer.vllm.worker.staging import ReaderStaging, auto_staging_bytes, region_tensors
from pdxfer.vllm.worker.worker_stats import GuardDeltas, WorkerStats

log = logging.getLogger("pdxfer.vllm.worker")

# How long get_finished waits for a release answer before leaving it to the next step: a
# master on the same rack answers in well under this; a slow one costs a step, never a stall.
_INLINE_RELEASE_WAIT_S = 0.003
# Rounds of re-pulls per load: each skips every holder that failed before it.
_MAX_REPULL_ROUNDS = 2
# Master calls off the step path at once (validations, re-pull lookups, unused-lock releases).
_MASTER_CALL_THREADS = 4


class LayoutMismatch(RuntimeError):
    """The KV tensors vLLM allocated do not match the layout the scheduler derived."""


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, *, node_id: str, rank: int, expected_fingerprint: str,
                 block_size: int, client_factory: Any = None, kv_format: str | None = None,
                 tp_size: int = 1, total_kv_heads: int = 0, kv_dtype: str | None = None,
                 max_model_len: int = 0, kv_groups: KVGroups | None = None):
        """``rank`` of ``tp_size``: this worker's TP rank; ``total_kv_heads``: the model's KV heads
        over all ranks (0: this rank's tensors have them all, i.e. TP 1); ``max_model_len``: the
        longest sequence, to size staging from (0: as many tokens as the KV cache holds);
        ``kv_groups``: a hybrid model's KV cache groups (None: one full-attention group)."""
        self.kv_groups = kv_groups or KVGroups.plain()
        self.cfg = cfg
        self.node_id = node_id
        self.rank = rank
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        self.expected_fingerprint = expected_fingerprint
        self.kv_format = kv_format  # None: from the tensor shape (the shape cannot tell AMX packing)
        self.kv_dtype = kv_dtype  # None: the tensors' (a uint8 tensor cannot tell which fp8 it holds)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._client_factory = client_factory
        self._client: Any = None
        self.layout: KVLayout | None = None
        self._staging: ReaderStaging | None = None
        self.transport: Any = None
        self._kv_caches: Mapping[str, Any] | None = None  # keeps registered memory alive
        self.host_pool: HostPool | None = None
        self._offloads_done: dict[int, int] = {}
        self._offloads_failed: dict[int, str] = {}
        self.stats = WorkerStats()
        self._guards = GuardDeltas()
        self.peers = HolderPeers(cfg, rank=rank, tp_size=tp_size)
        self.reads = LoadReads(cfg, self.peers, self.stats)
        # Validations, re-pull lookups and unused-lock releases: several at once, so loads that end
        # together against a slow master do not queue one master call behind another.
        self._releaser = ThreadPoolExecutor(_MASTER_CALL_THREADS, thread_name_prefix="pdxfer-validate")
        self._inflight: dict[str, Load] = {}
        self._done_ok: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed since the last take
        self._stop_bound_s = 10 * cfg.load_timeout_s
        # History hook (the chaos checker's): when a list, every round of reads whose release
        # answered is appended to it (see _record_round). None in production.
        self.round_log: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ start

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> PdxferHandshake:
        layout = describe_kv_caches(kv_caches, block_size=self.block_size, kv_format=self.kv_format,
                                    dtype=self.kv_dtype)
        if layout.fingerprint() != self.expected_fingerprint:
            raise LayoutMismatch(f"KV tensors have layout {layout.fingerprint()} but the scheduler "
                                 f"derived {self.expected_fingerprint} from the vLLM config; keys "
                                 "would not match what the bytes are")
        check_reachable(self.cfg)
        opts = transport_options(self.cfg.transport, listen_host=self.cfg.listen_host,
                                 listen_port=self.cfg.listen_port, advertise_host=self.cfg.advertise_host)
        transport = create_transport(self.cfg.transport, **opts)
        if not self.total_kv_heads:
            self.total_kv_heads = layout.kv_heads * self.tp_size
        kv_bytes = region_tensors(kv_caches, layout)
        self._staging = ReaderStaging(self._staging_bytes(layout), layout, kv_bytes)
        # Device regions carry their bytes as tensors: transports without a device path (TCP)
        # copy through a pinned host bounce buffer with them.
        regions = [RegisteredRegion(r.index, r.ptr, r.nbytes, r.device, tensor=t)
                   for r, t in zip(layout.regions, kv_bytes)]
        regions += [self._staging.region()] if self._staging.enabled else []
        layout_wire = layout.to_wire()
        host_mib = self.cfg.host_tier_mib
        if self.kv_groups.hybrid:
            layout_wire[GROUPS_LAYOUT_KEY] = self.kv_groups.to_wire()
            if host_mib:
                log.warning("pdxfer: node %s: the host tier is off for hybrid models (KV cache groups %s)",
                            self.node_id, self.kv_groups.signature())
            host_mib = 0
        if host_mib is None:
            host_mib = auto_host_tier_mib(self.tp_size)
            log.info("pdxfer: node %s rank %d host tier auto: %d MiB (%.0f%% of the available memory over %d "
                     "TP rank(s))", self.node_id, self.rank, host_mib, AUTO_HOST_SHARE * 100, self.tp_size)
        host_blocks = host_slots_for(host_mib, layout.bytes_per_block)
        if host_blocks:
            placeholders = [Region(r.index, r.nbytes, r.device) for r in regions]
            self.host_pool = HostPool(layout, kv_bytes, host_blocks, placeholders, self._staging.ops)
            regions.append(self.host_pool.region())
            layout_wire[HOST_LAYOUT_KEY] = self.host_pool.layout.to_wire()
        transport.register(regions)
        self.layout, self.transport, self._kv_caches = layout, transport, kv_caches
        self.peers.attach(layout, transport, self._staging, self.total_kv_heads)
        self.reads.attach(transport, self._staging)
        if self.host_pool is not None:
            log.info("pdxfer: node %s rank %d host tier: %d blocks, %.0f MiB of pinned host memory",
                     self.node_id, self.rank, host_blocks, self.host_pool.nbytes / 2**20)
        log.info("pdxfer: node %s rank %d/%d registered %d KV region(s), %d blocks x %d bytes (%d of %d KV "
                 "heads), transport %s, staging %.0f MiB", self.node_id, self.rank, self.tp_size,
                 len(layout.regions), layout.num_blocks, layout.bytes_per_block, layout.kv_heads,
                 self.total_kv_heads, self.cfg.transport, self._staging.nbytes / 2**20)
        return PdxferHandshake(self.node_id, self.rank, self.cfg.transport, transport.metadata(),
                               layout_wire, layout.fingerprint(), tp_size=self.tp_size,
                               total_kv_heads=self.total_kv_heads, dtype=layout.dtype,
                               kv_format=layout.kv_format, block_size=layout.block_size,
                               host_blocks=host_blocks)

    def _staging_bytes(self, layout: KVLayout) -> int:
        """``staging_mib`` when set, else from the model (longer loads stream through it)."""
        if self.cfg.staging_mib is not None:
            return self.cfg.staging_mib << 20
        max_tokens = self.max_model_len or layout.num_blocks * layout.block_size
        return auto_staging_bytes(layout, self.total_kv_heads, max_tokens, self.cfg.staging_max_mib)

    def _master(self) -> Any:
        if self._client is None:
            factory = self._client_factory
            if factory is None:
                from pdxfer.master import MasterClient

                factory = MasterClient
            # Validation is on the step path: a slow master costs a recompute, not a stalled engine.
            self._client = factory(self.cfg.master, token=self.cfg.token, timeout_s=self.cfg.lookup_timeout_s)
        return self._client

    # ------------------------------------------------------------------ loads

    def start_loads(self, meta: PdxferConnectorMetadata) -> None:
        if meta.offloads:
            self._start_offloads(meta)
        if not meta.loads:
            return
        meta.check()
        for spec in meta.loads:
            if spec.req_id not in self._inflight:  # the same metadata bound twice posts once
                self._post(spec, {h.node_id: h for h in spec.holders})  # this load's own lookup

    # ------------------------------------------------------------------ host tier (holder)

    def _start_offloads(self, meta: PdxferConnectorMetadata) -> None:
        for job in meta.offloads:
            if self.host_pool is None:  # the scheduler thinks otherwise: the copy never happens
                self._offloads_failed[job.job_id] = f"rank {self.rank} has no host tier"
                continue
            try:
                self.host_pool.start(job)
            except Exception as exc:
                self._offloads_failed[job.job_id] = f"{type(exc).__name__}: {exc}"

    def take_stats(self) -> dict[str, Any] | None:
        """This step's connector stats: the loads' and the holder's guard counts (GuardDeltas)."""
        return self._guards.merge(self.stats.take(), self.transport)

    def take_worker_meta(self) -> PdxferWorkerMeta | None:
        """Offload jobs that ended on this rank since the last call (vLLM sums every rank's)."""
        if self.host_pool is not None:
            done, failed = self.host_pool.poll()
            for job in done:
                self._offloads_done[job] = 1
            self._offloads_failed.update(failed)
        if not self._offloads_done and not self._offloads_failed:
            return None
        out = PdxferWorkerMeta(self._offloads_done, self._offloads_failed)
        self._offloads_done, self._offloads_failed = {}, {}
        return out

    # ------------------------------------------------------------------ loads (reader)

    def _post(self, spec: LoadSpec, nodes: Mapping[str, HolderRef]) -> Load:
        now = time.time()
        inf = Load(spec, [], time.monotonic(), 0)
        inf.load_started, inf.load_tokens = inf.started, spec.num_tokens
        if spec.looked_up_at > 0:
            self.stats.phases.add("post", now - spec.looked_up_at)
        self._inflight[spec.req_id] = inf
        if not spec.reads:
            inf.error = "no plan"
            return inf
        if now >= spec.lock_expires_at:
            inf.error = "lock expired before the read was posted"
            return inf
        self.reads.post_all(inf, nodes)
        if not inf.pending:
            inf.enter(LoadPhase.READING)
        return inf

    def get_finished(self) -> set[str]:
        """Requests whose load ended (loaded or failed) since the last call; never blocks on reads."""
        out: set[str] = set()
        if self._staging is not None:
            self._staging.sweep()
        if not self._inflight:
            return out
        delay = test_hook_float("read_delay_s")
        for req_id, inf in list(self._inflight.items()):
            if inf.phase is LoadPhase.REPULLING:
                assert inf.repull_lookup is not None
                ended = inf.repull_lookup.done() and self._repull_round(inf)
            elif inf.phase is LoadPhase.VALIDATING:
                ended = self._validate(inf, 0.0)
            else:
                ended = self._follow_reads(inf, delay)
            if ended:
                out.add(req_id)
        return out

    def _follow_reads(self, inf: Load, delay: float | None) -> bool:
        """A connecting or reading load: True once it ended (failed with nothing to re-pull, or
        validated within this step's short wait)."""
        state = self._state(inf, delay)
        if state is None:
            return False
        if state == "failed" or not inf.spec.lock_id:
            self._drop_departed(inf)
            if not (inf.blame or inf.erred()) or not inf.stopped() or not self._may_repull(inf):
                self._release_unused(inf.spec.lock_id)
                self._conclude(inf, False)
                del self._inflight[inf.spec.req_id]
                return True
            # A holder failed it: re-pull from another one. Only what no finished read
            # wrote is read again; whether those reads count is this round's release.
            inf.round_failed = True
        else:
            maybe_corrupt_load(self.layout, inf.spec.req_id, inf.spec.blocks, inf.spec.groups)  # test hook; off in production
            self.stats.phases.add("read", time.monotonic() - inf.started)
        # The bytes are in; only the master can say whether the lock held throughout.
        # Ask off the step path; a quick answer is still taken in this same step.
        inf.enter(LoadPhase.VALIDATING)
        inf.validating_since = time.monotonic()
        inf.validation = self._releaser.submit(self._master().release, inf.spec.lock_id)
        return self._validate(inf, _INLINE_RELEASE_WAIT_S)

    def _validate(self, inf: Load, wait: float) -> bool:
        """The master's word on the lock, waited for up to ``wait``: True once the load ended
        (loaded, or failed), False while the answer or a re-pull is still to come."""
        assert inf.validation is not None
        try:
            try:
                valid = bool(inf.validation.result(timeout=wait))
            except FutureTimeout:
                if time.monotonic() < self._validation_deadline(inf):
                    return False
                inf.validation.cancel()  # if still queued; an answer arriving later is ignored
                raise TimeoutError(f"no answer within {self._validation_deadline(inf) - inf.validating_since:.2f} s")
            if not valid and not inf.round_failed:
                inf.error = "lock expired during the read (master refused the release)"
        except Exception as exc:
            valid = False
            inf.error = f"release failed, bytes cannot be validated: {exc}"
            inf.round_failed = False  # no master to look up at either: recompute
        else:
            self._record_round(inf, valid)
            if (inf.round_failed or not valid) and self._may_repull(inf):
                self._start_repull(inf, valid)
                return False
        self.stats.phases.add("release", time.monotonic() - inf.validating_since)
        self._conclude(inf, valid and not inf.round_failed)
        del self._inflight[inf.spec.req_id]
        return True

    # ------------------------------------------------------------------ re-pulls

    def _record_round(self, inf: Load, valid: bool) -> None:
        """For the history checker: what this round's reads wrote, and whether it counts (the
        lock held, and the holder's reads finished)."""
        if self.round_log is None:
            return
        incomplete = sorted(inf.incomplete() | inf.erred()) if inf.round_failed else []
        self.round_log.append({
            "req": inf.spec.req_id, "round": inf.rounds, "lock": inf.spec.lock_id, "valid": valid,
            "failed": inf.round_failed, "incomplete": incomplete,
            "reads": [{"node": r.node_id, "local": list(r.local_blocks), "staged": bool(r.remote_block_size),
                       "start": r.start, "tokens": r.num_tokens} for r in inf.spec.reads]})

    def _validation_deadline(self, inf: Load) -> float:
        """When a load stops waiting for the master's word on its lock (and is recomputed): its
        load bound, but never less than one master call after the release was asked."""
        return max(inf.load_started + self.cfg.load_timeout_s, inf.validating_since + self.cfg.lookup_timeout_s)

    def _may_repull(self, inf: Load) -> bool:
        # Time for a lookup and a read is left, and not every round already failed.
        left = inf.load_started + self.cfg.load_timeout_s - time.monotonic()
        return (inf.spec.repull is not None and bool(inf.spec.lock_id) and inf.rounds < _MAX_REPULL_ROUNDS
                and left > min(self.cfg.lookup_timeout_s, self.cfg.load_timeout_s / 4))

    def _start_repull(self, inf: Load, valid: bool) -> None:
        """Look the range up again (off the step path), skipping every holder that failed this load."""
        spec, rp = inf.spec, inf.spec.repull
        assert rp is not None and self.layout is not None
        epochs = {h.node_id: h.epoch for h in spec.holders}
        if valid:
            failed = set(inf.blame) | inf.erred()
            incomplete: set[str] | None = inf.incomplete() | failed
        else:  # the master refused the lock: no byte of this round counts, and its holders are suspect
            failed, incomplete = {r.node_id for r in spec.reads}, None
        for node in failed:
            inf.skipped[node] = epochs.get(node, 0)
        t0 = rp_plan.restart_token(rp, spec.reads, incomplete, self.block_size)
        skip = dict(rp.skip)
        skip.update(inf.skipped)
        inf.repull_from = t0
        inf.error = inf.error or "lock refused at release"
        log.info("pdxfer: %s: holder(s) %s failed the load (%s); looking tokens [%d, %d) up again without them",
                 spec.req_id, ", ".join(sorted(failed)) or "?", inf.error, t0, rp.end)
        inf.enter(LoadPhase.REPULLING)
        inf.repull_lookup = self._releaser.submit(
            self._master().lookup_and_lock, rp_plan.lookup_keys(rp, t0), rp.reader, lock_ttl_s=rp.lock_ttl_s,
            parties=1, skip=skip, transport=self.cfg.transport)

    def _repull_round(self, inf: Load) -> bool:
        """The re-pull lookup answered: post the next round (False), or conclude the load (True)."""
        spec, rp, t0 = inf.spec, inf.spec.repull, inf.repull_from
        assert rp is not None
        fut, inf.repull_lookup = inf.repull_lookup, None
        lost = rp_plan.blocks_from(rp, t0, self.block_size)
        try:
            res = fut.result(timeout=0)
        except Exception as exc:
            return self._repull_failed(inf, lost, f"{inf.error}; re-pull lookup failed: {exc}")
        try:
            plan = rp_plan.plan_repull(rp, t0, res, self.block_size,
                                       lambda ref: self.peers.readable(ref, self.node_id))
        except Exception as exc:
            plan = None
            why = f"{inf.error}; cannot plan the re-pull: {type(exc).__name__}: {exc}"
        else:
            why = f"{inf.error}; no other holder has tokens [{t0}, {rp.end})"
        if plan is None or not plan.reads or res.lock_id is None:
            if res.lock_id is not None:
                self._release_unused(res.lock_id, all_parties=True)
            return self._repull_failed(inf, lost, why)
        new = dataclasses.replace(spec, lock_id=res.lock_id, num_tokens=plan.end - t0, reads=plan.reads,
                                  lock_expires_at=time.time() + res.lock_ttl_s, blocks=tuple(sorted(lost)),
                                  looked_up_at=0.0, holders=plan.holders, repull=plan.spec)
        log.warning("pdxfer: %s: re-pulling %d chunk(s), tokens [%d, %d), from holder(s) %s instead of %s (%s)%s",
                    spec.req_id, plan.chunks, t0, plan.end, ", ".join(h.node_id for h in plan.holders),
                    ", ".join(sorted(inf.skipped)), inf.error,
                    f"; {len(plan.lost)} block(s) past token {plan.end} are recomputed" if plan.lost else "")
        nxt = self._post(new, {h.node_id: h for h in plan.holders})
        nxt.load_started, nxt.load_tokens = inf.load_started, inf.load_tokens
        nxt.rounds, nxt.skipped = inf.rounds + 1, inf.skipped
        nxt.lost = inf.lost | plan.lost
        nxt.repulled = inf.repulled + plan.chunks
        inf.enter(LoadPhase.SUPERSEDED)
        self._discard_round(inf)
        return False

    def _repull_failed(self, inf: Load, lost: set[int], why: str) -> bool:
        """No re-pull could be made: the blocks from the re-pull's first token on are recomputed
        (those before it were written by finished reads the master validated)."""
        inf.error = why
        inf.lost |= lost
        self._conclude(inf, False, errors=inf.lost)
        self._discard_round(inf)
        del self._inflight[inf.spec.req_id]
        return True

    def _discard_round(self, inf: Load) -> None:
        """Staging of a round that stopped (all its reads did before its release was asked)."""
        if inf.staged and self._staging is not None:
            self._staging.release(inf.staged)

    def _drop_departed(self, inf: Load) -> None:
        """Forget holders whose read failed because they are gone (their sockets, NIXL agents):
        a reader must not keep one per holder that ever left. A later load reconnects."""
        for h, key in zip(inf.handles, inf.handle_nodes):
            if isinstance(h.error, (PeerDied, PeerUnreachable)):
                node_id = "%s rank %d" % key
                existed, exc = self.peers.disconnect(key)
                if existed:
                    if exc is not None:
                        log.debug("pdxfer: disconnect from departed holder %s: %s", node_id, exc)
                    log.info("pdxfer: dropped the connection to holder %s (%s)", node_id, h.error)

    def _release_unused(self, lock_id: str, all_parties: bool = False) -> None:
        """A failed load still pins its holder's entries at the master: let go, off the step path."""
        if lock_id:  # else no client is made for it
            release_off_path(self._releaser, self._master().release, lock_id, all_parties)

    def _state(self, inf: Load, delay: float | None) -> str | None:
        """"done", "failed", or None while the load goes on. A failed load is reported only once
        every read of it has stopped: vLLM reuses (or recomputes into) the blocks right after, so
        a byte landing later would be wrong KV in another request."""
        if inf.error is None:
            if self.reads.progress(inf, delay) == "done":
                return "done"
            if inf.error is None:
                return None
            self.reads.cancel(inf)
        if inf.stopped():
            return "failed"
        if time.monotonic() - inf.started > self._stop_bound_s:
            # Transports bound their own stops (socket timeouts, UCX errors); past this bound a
            # transport broke that promise. Cut the connections those reads use, so no more
            # bytes can land in our blocks, before vLLM gets the blocks back; the staging ranges
            # stay out of use until the reads stop (or a grace period after the disconnect).
            self._disconnect_unstopped(inf)
            return "failed"
        return None

    def _disconnect_unstopped(self, inf: Load) -> None:
        # A scatter still running on the device is no read: disconnecting cannot stop it.
        keys = inf.running_reads()
        if not keys:  # only scatters on the device are still running: nothing to disconnect
            log.error("pdxfer: the scatter from staging for %s on %s has not completed %.0f s after the load "
                      "failed (%s); reporting the load failed: its blocks may still be written by it, its staging "
                      "stays out of use until it completes", inf.spec.req_id,
                      self._staging.device if self._staging is not None else "?", self._stop_bound_s, inf.error)
            return
        self.stats.reads_unstopped += len(keys)
        failed = []
        for key in keys:
            existed, exc = self.peers.disconnect(key)  # not existed: another load's disconnect ran
            if exc is not None:
                failed.append(f"{key[0]} rank {key[1]}: {exc}")
        log.error("pdxfer: read(s) for %s from holder(s) %s have not stopped %.0f s after the load failed (%s); "
                  "%s, reporting the load failed (a later load reconnects)", inf.spec.req_id,
                  ", ".join("%s rank %d" % k for k in keys), self._stop_bound_s, inf.error,
                  "disconnected them so no more bytes can land" if not failed else
                  f"disconnecting failed ({'; '.join(failed)}): its blocks may still receive bytes, its "
                  "staging stays out of use until the reads stop")
        inf.unstopped = keys if not failed else []

    def _conclude(self, inf: Load, valid: bool, errors: set[int] | None = None) -> None:
        """Count and log a load that ended; a load not validated at the master fails its blocks.
        Its staging ranges are free again, unless a read may still land in them (quarantined)."""
        if inf.staged and self._staging is not None:
            if inf.stopped():
                self._staging.release(inf.staged)
            else:
                held = self._staging.quarantine(
                    inf.staged, [h for h in inf.handles if h is not NOT_POSTED], bool(inf.unstopped),
                    f"the failed load of {inf.spec.req_id}")
                log.error("pdxfer: %d staging bytes of the failed load of %s stay out of use until its reads "
                          "stop%s", held, inf.spec.req_id,
                          " (or shortly after the disconnect)" if inf.unstopped else "")
        spec = inf.spec
        elapsed = time.monotonic() - inf.started
        # vLLM sums connector stats over TP ranks, and every rank sees every load: successes and
        # tokens are counted by rank 0 only, bytes (each rank's own heads) by every rank, and a
        # failure by each rank it happened on (a load that failed on rank 1 only also shows as
        # rank 0's success: loads_failed is the signal to watch with TP).
        counts = 1 if self.rank == 0 else 0
        if inf.error is None and valid:
            self.stats.repulls += inf.repulled  # only chunks a validated re-pull loaded
        inf.enter(LoadPhase.DONE if inf.error is None and valid and not inf.lost else LoadPhase.FAILED)
        if inf.error is None and valid and not inf.lost:
            self.stats.loads_ok += counts
            self.stats.tokens_loaded += inf.load_tokens * counts
            if inf.host_reads:
                self.stats.host_tier_tokens_loaded += inf.load_tokens * counts
            self.stats.bytes_loaded += inf.nbytes
            if spec.groups and self.layout is not None:
                for kind, blocks in spec.groups:
                    self.stats.add_group_bytes(kind, len(blocks) * self.layout.bytes_per_block)
            self.stats.transfer_s.append(time.monotonic() - inf.load_started)
            self.reads.observe(inf, elapsed)
            log.info("pdxfer: loaded %d tokens (%.1f MiB) for %s in %.2f ms%s", inf.load_tokens,
                     inf.nbytes / 2**20, spec.req_id, (time.monotonic() - inf.load_started) * 1e3,
                     f" ({inf.repulled} chunk(s) re-pulled)" if inf.repulled else "")
            return
        self.stats.loads_failed += 1
        if self.kv_groups.hybrid:  # only a hybrid model's failures are reported by request
            self._failed_loads.add(spec.req_id)
        if inf.error is None and valid:  # re-pulled, but blocks past what the other holders had are lost
            self._load_errors |= inf.lost
            log.warning("pdxfer: load for %s re-pulled %d chunk(s); %d block(s) are recomputed", spec.req_id,
                        inf.repulled, len(inf.lost))
            return
        self._load_errors |= errors if errors is not None else spec.local_blocks | inf.lost
        log.warning("pdxfer: load of %d tokens for %s failed (%s); recomputing", spec.num_tokens,
                    spec.req_id, inf.error)

    def connected_holders(self) -> list[str]:
        """Holder node ids this reader keeps a transport connection to (to any of their ranks)."""
        return self.peers.connected_holders()

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_failed_loads(self) -> set[str]:
        """Requests whose load failed since the last call (a hybrid model's failures are named by
        request: vLLM cannot map block ids of several KV cache groups back to requests)."""
        out, self._failed_loads = self._failed_loads, set()
        return out

    def close(self) -> None:
        for inf in self._inflight.values():
            self.reads.cancel(inf)
        self._inflight.clear()
        self.peers.close()
        self._releaser.shutdown(wait=False, cancel_futures=True)
        for part in (self.transport, self._client):  # best effort: the process is going anyway
            if part is not None:
                try:
                    part.close()
                except Exception as exc:
                    log.debug("pdxfer: closing %s: %s", type(part).__name__, exc)
