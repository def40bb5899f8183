"""Worker half of the pdxfer connector: register KV once, post reads, validate, report.

Runs in vLLM's worker process. Reads are posted when the step's metadata arrives and checked
(never waited on) at the end of each step; a finished read is only reported as loaded after
the master confirmed, at ``release``, that the lock held for the whole read. Anything else -- a
failed or timed-out read, a vanished holder, an expired lock, an unreachable master -- reports
the request's blocks as load errors, and vLLM recomputes them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdxfer.kv.layout import KVLayout, describe_kv_caches
from pdxfer.planning.convert import ConvertingPlanner
from pdxfer.planning.peer_plan import PeerPlanner
from pdxfer.vllm.worker.staging import (ReaderStaging, ScatterHandle, StagedStream, StagingFull, StagingTooSmall,
                                        auto_staging_bytes, region_tensors)
from pdxfer.transport import create_transport, transport_options
from pdxfer.transport.base import (PeerDied, PeerUnreachable, ReadHandle, ReadState, RegisteredRegion,
                                   TransferCancelled)
from pdxfer.contracts.connector_config import ConnectorConfig, check_reachable
from pdxfer.vllm.faults.hooks import test_hook_float
from pdxfer.vllm.faults.load_corruption import maybe_corrupt_load
from pdxfer.vllm.worker import repull as rp_plan
from pdxfer.vllm.holder_routes import NotReadable, Route, holder_total_heads, layouts_of, routes
from pdxfer.vllm.worker.host_pool import AUTO_HOST_SHARE, HostPool, auto_host_tier_mib, host_slots_for
from pdxfer.vllm.load_plan import split_by_tier
from pdxfer.kv.tiers import HOST_LAYOUT_KEY
from pdxfer.vllm.metadata import HolderRef, LoadSpec, PdxferConnectorMetadata, PdxferHandshake, PdxferWorkerMeta
from pdxfer.kv.layout import Region
from pdxfer.contracts.phase_times import PhaseTimes

log = logging.getLogger("pdxfer.vllm.worker")

# How long get_finished waits for a release answer before leaving it to the next step: a
# master on the same rack answers in well under this; a slow one costs a step, never a stall.
_INLINE_RELEASE_WAIT_S = 0.003
# Rounds of re-pulls per load: each skips every holder that failed before it.
_MAX_REPULL_ROUNDS = 2
# Master calls off the step path at once (validations, re-pull lookups, unused-lock releases).
_MASTER_CALL_THREADS = 4
# Until a holder's first load is seen: low for any transport pdxfer runs on, so the first read's
# bound is generous (4 MiB -> 0.5 s + 0.34 s).
_ASSUMED_BANDWIDTH = 50e6


class _NotPosted(ReadHandle):
    """Stands in ``_Inflight.handles`` for a staged piece not posted yet (waiting for room):
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


_NOT_POSTED = _NotPosted()


class LayoutMismatch(RuntimeError):
    """The KV tensors vLLM allocated do not match the layout the scheduler derived."""


@dataclass
class _Inflight:
    spec: LoadSpec
    handles: list[ReadHandle]
    started: float
    nbytes: int
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
    transfer_s: list[float] = field(default_factory=list)
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    def take(self) -> dict[str, Any] | None:
        if not (self.loads_ok or self.loads_failed):
            return None
        out = {"loads_ok": self.loads_ok, "loads_failed": self.loads_failed,
               "tokens_loaded": self.tokens_loaded, "bytes_loaded": self.bytes_loaded,
               "staging_waits": self.staging_waits, "staging_full": self.staging_full,
               "reads_unstopped": self.reads_unstopped, "repulls": self.repulls,
               "host_tier_tokens_loaded": self.host_tier_tokens_loaded,
               "transfer_s": list(self.transfer_s)}
        out.update(self.phases.take())
        self.loads_ok = self.loads_failed = self.tokens_loaded = self.bytes_loaded = 0
        self.staging_waits = self.staging_full = self.reads_unstopped = self.repulls = 0
        self.host_tier_tokens_loaded = 0
        self.transfer_s = []
        return out


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, *, node_id: str, rank: int, expected_fingerprint: str,
                 block_size: int, client_factory: Any = None, kv_format: str | None = None,
                 tp_size: int = 1, total_kv_heads: int = 0, kv_dtype: str | None = None,
                 max_model_len: int = 0):
        """``rank`` of ``tp_size``: this worker's TP rank; ``total_kv_heads``: the model's KV heads
        over all ranks (0: this rank's tensors have them all, i.e. TP 1); ``max_model_len``: the
        longest sequence, to size staging from (0: as many tokens as the KV cache holds)."""
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
        # (holder node, rank) -> (planner for its host slots, its device block count)
        self._host_planners: dict[tuple[str, int], tuple[PeerPlanner | ConvertingPlanner, int]] = {}
        # (node, holder rank) -> (its metadata, transport peer id, planner made once at connect)
        self._peers: dict[tuple[str, int], tuple[bytes, str, PeerPlanner | ConvertingPlanner]] = {}
        self._peers_lock = threading.Lock()
        self._connecting: dict[tuple[str, int], Future] = {}
        # holder (node id, what it announced) -> this rank's routes to it, or why it cannot read it
        self._routes: dict[tuple[str, str], list[Route] | str] = {}
        self._connect_pool = ThreadPoolExecutor(1, thread_name_prefix="pdxfer-connect")
        # Validations, re-pull lookups and unused-lock releases: several at once, so loads that end
        # together against a slow master do not queue one master call behind another.
        self._releaser = ThreadPoolExecutor(_MASTER_CALL_THREADS, thread_name_prefix="pdxfer-validate")
        self._inflight: dict[str, _Inflight] = {}
        self._done_ok: set[str] = set()
        self._load_errors: set[int] = set()
        self._stop_bound_s = 10 * cfg.load_timeout_s
        self._bandwidth: dict[str, float] = {}  # holder node -> bytes/s its loads achieved
        # History hook (the chaos checker's): when a list, every round of reads whose release
        # answered is appended to it (see _record_round). None in production.
        self.round_log: list[dict[str, Any]] | None = None
        self.stats = WorkerStats()

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

    def _post(self, spec: LoadSpec, nodes: Mapping[str, HolderRef]) -> _Inflight:
        now = time.time()
        inf = _Inflight(spec, [], time.monotonic(), 0)
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
        for i, r in enumerate(spec.reads):
            ref = nodes[r.node_id]
            try:
                my_routes = self._routes_to(ref)
            except NotReadable as exc:  # the scheduler thought otherwise: never read wrong bytes
                inf.error = str(exc)
                return inf
            # One read per holder rank holding some of this rank's heads (TP: several, or a
            # slice of one); the load is loaded only when all of them finished.
            for route in my_routes:
                if self._connected(ref, route):
                    self._post_read(inf, ref, route, r)
                else:
                    # Connecting to a new holder (a NIXL agent takes ~0.2 s here) happens off the
                    # step path; the read is posted from get_finished once the connection is up.
                    self._start_connect(ref, route)
                    inf.pending.append((ref, route, r))
                if inf.error is not None:
                    inf.unposted |= {x.node_id for x in spec.reads[i:]}
                    return inf
        return inf

    def _routes_to(self, ref: HolderRef) -> list[Route]:
        """This rank's reads from holder ``ref`` (decided once per holder and what it announced)."""
        assert self.layout is not None
        sig = repr([(e.rank, e.transport_metadata, e.layout.get("block_size")) for e in ref.endpoints])
        key = (ref.node_id, f"{ref.total_kv_heads}:{sig}")
        got = self._routes.get(key)
        if got is None:
            try:
                layouts = layouts_of(ref.endpoints)
                total = holder_total_heads(ref.total_kv_heads, len(layouts), layouts[0])
                got = routes(ref.node_id, layouts, total, self.layout, self.tp_size, self.rank,
                             self.total_kv_heads or self.layout.kv_heads * self.tp_size,
                             staging=self._staging is not None and self._staging.enabled,
                             chunk_tokens=self.cfg.chunk_tokens)
            except NotReadable as exc:
                got = str(exc)
            if len(self._routes) >= 1024:  # bounded: holders come and go over a long life
                self._routes.clear()
            self._routes[key] = got
        if isinstance(got, str):
            raise NotReadable(got)
        return got

    def _post_read(self, inf: _Inflight, ref: HolderRef, route: Route, r: Any) -> None:
        assert self.layout is not None and self.transport is not None
        try:
            at, peer, planner = self._peers[(ref.node_id, route.holder_rank)]
            if at != ref.endpoint(route.holder_rank).transport_metadata:  # reconnected for another load's lookup
                raise RuntimeError(f"holder {ref.node_id} rank {route.holder_rank} is connected as another registration")
            host = self._host_planners.get((ref.node_id, route.holder_rank))
            if host is not None and max(r.remote_blocks, default=-1) >= host[1]:
                self._post_host_read(inf, ref, route, r, peer, planner, *host)
                return
            if isinstance(planner, ConvertingPlanner):  # READ into staging piece by piece, convert each
                self._post_stream(inf, ref, route, planner, r, peer)
                return
            self._post_direct(inf, ref, route, planner, r, peer)
        except Exception as exc:
            if isinstance(exc, StagingTooSmall):
                self.stats.staging_full += 1
            if isinstance(exc, (PeerDied, PeerUnreachable)):
                inf.blame.add(ref.node_id)
            inf.error = f"{type(exc).__name__}: {exc}"

    def _post_direct(self, inf: _Inflight, ref: HolderRef, route: Route, planner: PeerPlanner, r: Any,
                     peer: str) -> None:
        """One transport read of ``r``'s block pairs straight into place."""
        plan = planner.plan(list(r.remote_blocks), list(r.local_blocks))
        inf.nbytes += plan.total_bytes
        inf.handles.append(self.transport.read(peer, plan))
        inf.handle_nodes.append((ref.node_id, route.holder_rank))
        bound = self._read_bound(ref.node_id, plan.total_bytes)
        inf.read_deadline = max(inf.read_deadline, time.monotonic() + bound)

    def _post_stream(self, inf: _Inflight, ref: HolderRef, route: Route, planner: ConvertingPlanner, r: Any,
                     peer: str) -> None:
        """A staged read of ``r``: its pieces are posted as the staging area has room."""
        assert self._staging is not None
        stream = self._staging.stream(planner, r, peer)
        inf.staged.append(stream)
        inf.stream_slots.append(len(inf.handles))
        inf.handles.append(_NOT_POSTED)
        inf.handle_nodes.append((ref.node_id, route.holder_rank))
        self._post_piece(inf, len(inf.staged) - 1)

    def _post_host_read(self, inf: _Inflight, ref: HolderRef, route: Route, r: Any, peer: str,
                        planner: PeerPlanner | ConvertingPlanner, host_planner: PeerPlanner | ConvertingPlanner,
                        n_device: int) -> None:
        """A read naming some of the holder's host slots (block ids >= its device block count):
        each tier's blocks are planned against its own layout (split_by_tier), and each part
        goes the way its tier's planner says: straight into place, or staged and converted
        (another block size, format or head split), so the two tiers may differ."""
        inf.host_reads = True
        for on_host, part in split_by_tier(r, n_device):
            tier_planner = host_planner if on_host else planner
            if isinstance(tier_planner, ConvertingPlanner):
                self._post_stream(inf, ref, route, tier_planner, part, peer)
            elif part.remote_block_size:  # the scheduler planned token ranges for blocks of our size
                raise NotReadable(f"holder {ref.node_id} rank {route.holder_rank}: a token-range read of "
                                  f"{part.remote_block_size}-token blocks from its "
                                  f"{'host tier' if on_host else 'KV cache'}, whose blocks this rank reads "
                                  "block for block")
            else:
                self._post_direct(inf, ref, route, tier_planner, part, peer)

    def _post_piece(self, inf: _Inflight, i: int) -> None:
        """Post stream ``i``'s next piece if the staging area has room; else wait (bounded by
        the load's own bound), then fail naming the sizes."""
        assert self._staging is not None
        s = inf.staged[i]
        job = self._staging.next_piece(s)
        now = time.monotonic()
        if job is None:
            if not s.waiting_since:
                s.waiting_since = now
                if not inf.staging_waited:
                    inf.staging_waited = True
                    self.stats.staging_waits += 1
            if now - s.waiting_since > self.cfg.load_timeout_s:
                self.stats.staging_full += 1
                raise StagingFull(
                    f"no room in the staging area for {now - s.waiting_since:.2f} s: this read needs "
                    f"{s.unit} bytes per holder block ({s.remaining_bytes()} still to stage), other loads "
                    f"use {self._staging.area.in_use} of its {self._staging.nbytes} bytes; raise staging_mib "
                    f"or staging_max_mib")
            return
        s.waiting_since = 0.0
        try:
            handle = self.transport.read(s.peer, job.plan)
        except Exception:
            self._staging.release([s])  # nothing was posted into it
            raise
        inf.handles[inf.stream_slots[i]] = handle
        inf.nbytes += job.plan.total_bytes
        node = inf.handle_nodes[inf.stream_slots[i]][0]
        inf.read_deadline = max(inf.read_deadline, now + self._read_bound(node, job.plan.total_bytes))

    def _advance_streams(self, inf: _Inflight) -> bool:
        """Scatter every staged piece that landed and post the next one; True once every stream
        moved all its pieces. Sets ``inf.error`` when a piece cannot be scattered or posted."""
        assert self._staging is not None
        done = True
        for i, s in enumerate(inf.staged):
            slot = inf.stream_slots[i]
            h = inf.handles[slot]
            if s.job is not None and h is not _NOT_POSTED:
                if h.poll() is not ReadState.DONE:  # the read, or the scatter after it, still runs
                    done = False
                    continue
                try:
                    if s.scatter_event is None and not self._staging.start_scatter(s).query():
                        # Enqueued on the worker's stream: the range is freed, and the load can
                        # finish, only once the event after it completed (seen in a later step).
                        inf.handles[slot] = ScatterHandle(s.scatter_event, self._staging.device)
                        inf.read_deadline = max(inf.read_deadline, time.monotonic() + self.cfg.load_timeout_s)
                        done = False
                        continue
                    self._staging.finish_scatter(s)
                except Exception as exc:
                    if s.scatter_event is not None and not isinstance(inf.handles[slot], ScatterHandle):
                        inf.handles[slot] = ScatterHandle(s.scatter_event, self._staging.device)  # wait for it
                    inf.error = f"scatter from staging failed: {type(exc).__name__}: {exc}"
                    return False
            if s.finished:
                continue
            done = False
            if s.job is None:
                try:
                    self._post_piece(inf, i)
                except Exception as exc:
                    inf.error = f"{type(exc).__name__}: {exc}"
                    return False
        return done

    def _connected(self, ref: HolderRef, route: Route) -> bool:
        with self._peers_lock:
            cached = self._peers.get((ref.node_id, route.holder_rank))
        return cached is not None and cached[0] == ref.endpoint(route.holder_rank).transport_metadata

    def _start_connect(self, ref: HolderRef, route: Route) -> None:
        key = (ref.node_id, route.holder_rank)
        fut = self._connecting.get(key)
        if fut is not None and not fut.done():
            return  # under way (perhaps to older metadata: _post_pending checks and retries)
        self._connecting[key] = self._connect_pool.submit(self._connect, ref, route)

    def _connect(self, ref: HolderRef, route: Route) -> None:
        if ref.transport != self.cfg.transport:
            raise RuntimeError(f"holder {ref.node_id} uses transport {ref.transport}, this node {self.cfg.transport}")
        key = (ref.node_id, route.holder_rank)
        ep = ref.endpoint(route.holder_rank)
        with self._peers_lock:
            cached = self._peers.get(key)
        if cached is not None and cached[0] == ep.transport_metadata:
            return
        if cached is not None:  # the node restarted with new metadata
            try:
                self.transport.disconnect(cached[1])
            except Exception:
                pass
        assert self.layout is not None and self._staging is not None
        # The holder rank's layout is checked against ours once, here, not on every read.
        planner = self._staging.planner_for(KVLayout.from_wire(ep.layout), route)
        host_wire = ep.layout.get(HOST_LAYOUT_KEY)
        host = None
        if host_wire is not None:
            host = (self._staging.planner_for(KVLayout.from_wire(host_wire), route), int(ep.layout["num_blocks"]))
        peer = self.transport.connect(ep.transport_metadata, timeout=self._connect_bound())
        with self._peers_lock:
            self._peers[key] = (ep.transport_metadata, peer, planner)
            if host is not None:
                self._host_planners[key] = host
            else:
                self._host_planners.pop(key, None)

    def _post_pending(self, inf: _Inflight) -> bool:
        """Post reads whose connection came up; False while some connection is still pending."""
        still = []
        for ref, route, r in inf.pending:
            key = (ref.node_id, route.holder_rank)
            fut = self._connecting.get(key)
            if fut is None or not fut.done():
                if fut is None:
                    self._start_connect(ref, route)
                still.append((ref, route, r))
                continue
            exc = fut.exception()
            if exc is not None:
                inf.error = (f"cannot connect to holder {ref.node_id} rank {route.holder_rank}: "
                             f"{type(exc).__name__}: {exc}")
                self._connecting.pop(key, None)  # a later load may try again
                inf.blame.add(ref.node_id)
                inf.unposted |= {p[0].node_id for p in inf.pending}
                inf.pending = []
                return True
            if not self._connected(ref, route):  # that connect was for older metadata of this node
                self._connecting.pop(key, None)
                self._start_connect(ref, route)
                still.append((ref, route, r))
                continue
            self._post_read(inf, ref, route, r)
            if inf.error is not None:
                inf.unposted |= {p[0].node_id for p in inf.pending}
                inf.pending = []
                return True
        inf.pending = still
        return not still

    def get_finished(self) -> set[str]:
        """Requests whose load ended (loaded or failed) since the last call; never blocks on reads."""
        out: set[str] = set()
        if self._staging is not None:
            self._staging.sweep()
        if not self._inflight:
            return out
        delay = test_hook_float("read_delay_s")
        for req_id, inf in list(self._inflight.items()):
            if inf.repull_lookup is not None:
                if inf.repull_lookup.done() and self._repull_round(inf):
                    out.add(req_id)
                continue
            if inf.validation is None:
                state = self._state(inf, delay)
                if state is None:
                    continue
                if state == "failed" or not inf.spec.lock_id:
                    self._drop_departed(inf)
                    if not (inf.blame or self._erred(inf)) or not self._stopped(inf) or not self._may_repull(inf):
                        self._release_unused(inf.spec.lock_id)
                        self._conclude(inf, False)
                        del self._inflight[req_id]
                        out.add(req_id)
                        continue
                    # A holder failed it: re-pull from another one. Only what no finished read
                    # wrote is read again; whether those reads count is this round's release.
                    inf.round_failed = True
                else:
                    maybe_corrupt_load(self.layout, req_id, inf.spec.blocks)  # test hook; off in production
                    self.stats.phases.add("read", time.monotonic() - inf.started)
                # The bytes are in; only the master can say whether the lock held throughout.
                # Ask off the step path; a quick answer is still taken in this same step.
                inf.validating_since = time.monotonic()
                inf.validation = self._releaser.submit(self._master().release, inf.spec.lock_id)
                wait = _INLINE_RELEASE_WAIT_S
            else:
                wait = 0.0
            try:
                try:
                    valid = bool(inf.validation.result(timeout=wait))
                except FutureTimeout:
                    if time.monotonic() < self._validation_deadline(inf):
                        continue
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
                    continue
            self.stats.phases.add("release", time.monotonic() - inf.validating_since)
            self._conclude(inf, valid and not inf.round_failed)
            del self._inflight[req_id]
            out.add(req_id)
        return out

    # ------------------------------------------------------------------ re-pulls

    def _record_round(self, inf: _Inflight, valid: bool) -> None:
        """For the history checker: what this round's reads wrote, and whether it counts (the
        lock held, and the holder's reads finished)."""
        if self.round_log is None:
            return
        incomplete = sorted(self._incomplete(inf) | self._erred(inf)) if inf.round_failed else []
        self.round_log.append({
            "req": inf.spec.req_id, "round": inf.rounds, "lock": inf.spec.lock_id, "valid": valid,
            "failed": inf.round_failed, "incomplete": incomplete,
            "reads": [{"node": r.node_id, "local": list(r.local_blocks), "staged": bool(r.remote_block_size),
                       "start": r.start, "tokens": r.num_tokens} for r in inf.spec.reads]})

    def _validation_deadline(self, inf: _Inflight) -> float:
        """When a load stops waiting for the master's word on its lock (and is recomputed): its
        load bound, but never less than one master call after the release was asked."""
        return max(inf.load_started + self.cfg.load_timeout_s, inf.validating_since + self.cfg.lookup_timeout_s)

    def _past_load_bound(self, inf: _Inflight) -> bool:
        """A re-pull round lives within its load's load_timeout_s, counted from the first post."""
        return inf.rounds > 0 and time.monotonic() > inf.load_started + self.cfg.load_timeout_s

    def _may_repull(self, inf: _Inflight) -> bool:
        # Time for a lookup and a read is left, and not every round already failed.
        left = inf.load_started + self.cfg.load_timeout_s - time.monotonic()
        return (inf.spec.repull is not None and bool(inf.spec.lock_id) and inf.rounds < _MAX_REPULL_ROUNDS
                and left > min(self.cfg.lookup_timeout_s, self.cfg.load_timeout_s / 4))

    def _incomplete(self, inf: _Inflight) -> set[str]:
        """Holders of this round with a read that did not finish (or was never posted)."""
        nodes = set(inf.unposted) | set(inf.blame) | {p[0].node_id for p in inf.pending}
        for h, (node, _) in zip(inf.handles, inf.handle_nodes):
            if h is _NOT_POSTED or h.poll() is not ReadState.DONE:
                nodes.add(node)
        for s, slot in zip(inf.staged, inf.stream_slots):
            if not s.finished:
                nodes.add(inf.handle_nodes[slot][0])
        posted = {node for node, _ in inf.handle_nodes}
        return nodes | {r.node_id for r in inf.spec.reads if r.node_id not in posted}

    def _start_repull(self, inf: _Inflight, valid: bool) -> None:
        """Look the range up again (off the step path), skipping every holder that failed this load."""
        spec, rp = inf.spec, inf.spec.repull
        assert rp is not None and self.layout is not None
        epochs = {h.node_id: h.epoch for h in spec.holders}
        if valid:
            failed = set(inf.blame) | self._erred(inf)
            incomplete: set[str] | None = self._incomplete(inf) | failed
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
        inf.repull_lookup = self._releaser.submit(
            self._master().lookup_and_lock, rp_plan.lookup_keys(rp, t0), rp.reader, lock_ttl_s=rp.lock_ttl_s,
            parties=1, skip=skip, transport=self.cfg.transport)

    @staticmethod
    def _erred(inf: _Inflight) -> set[str]:
        """Holders whose read failed by itself (not by our cancel, not a scatter on our device)."""
        out = set()
        for h, (node, _) in zip(inf.handles, inf.handle_nodes):
            err = None if h is _NOT_POSTED or isinstance(h, ScatterHandle) else h.error
            if err is not None and not isinstance(err, TransferCancelled):
                out.add(node)
        return out

    def _readable(self, ref: HolderRef) -> bool:
        if ref.transport != self.cfg.transport or ref.node_id == self.node_id:
            return False
        try:
            self._routes_to(ref)
            return True
        except NotReadable:
            return False

    def _repull_round(self, inf: _Inflight) -> bool:
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
            plan = rp_plan.plan_repull(rp, t0, res, self.block_size, self._readable)
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
        self._discard_round(inf)
        return False

    def _repull_failed(self, inf: _Inflight, lost: set[int], why: str) -> bool:
        """No re-pull could be made: the blocks from the re-pull's first token on are recomputed
        (those before it were written by finished reads the master validated)."""
        inf.error = why
        inf.lost |= lost
        self._conclude(inf, False, errors=inf.lost)
        self._discard_round(inf)
        del self._inflight[inf.spec.req_id]
        return True

    def _discard_round(self, inf: _Inflight) -> None:
        """Staging of a round that stopped (all its reads did before its release was asked)."""
        if inf.staged and self._staging is not None:
            self._staging.release(inf.staged)

    def connected_holders(self) -> list[str]:
        """Holder node ids this reader keeps a transport connection to (to any of their ranks)."""
        with self._peers_lock:
            return sorted({node for node, _ in self._peers})

    def _drop_departed(self, inf: _Inflight) -> None:
        """Forget holders whose read failed because they are gone (their sockets, NIXL agents):
        a reader must not keep one per holder that ever left. A later load reconnects."""
        for h, key in zip(inf.handles, inf.handle_nodes):
            if isinstance(h.error, (PeerDied, PeerUnreachable)):
                node_id = "%s rank %d" % key
                with self._peers_lock:
                    cached = self._peers.pop(key, None)
                if cached is not None:
                    try:
                        self.transport.disconnect(cached[1])
                    except Exception as exc:
                        log.debug("pdxfer: disconnect from departed holder %s: %s", node_id, exc)
                    log.info("pdxfer: dropped the connection to holder %s (%s)", node_id, h.error)

    def _release_unused(self, lock_id: str, all_parties: bool = False) -> None:
        """A failed load still pins its holder's entries at the master: let go, off the step path."""
        if lock_id:
            try:
                self._releaser.submit(self._master().release, lock_id, all_parties)
            except RuntimeError:  # closing
                pass

    def _state(self, inf: _Inflight, delay: float | None) -> str | None:
        """"done", "failed", or None while the load goes on. A failed load is reported only once
        every read of it has stopped: vLLM reuses (or recomputes into) the blocks right after, so
        a byte landing later would be wrong KV in another request."""
        if inf.error is None:
            if self._progress(inf, delay) == "done":
                return "done"
            if inf.error is None:
                return None
            self._cancel(inf)
        if self._stopped(inf):
            return "failed"
        if time.monotonic() - inf.started > self._stop_bound_s:
            # Transports bound their own stops (socket timeouts, UCX errors); past this bound a
            # transport broke that promise. Cut the connections those reads use, so no more
            # bytes can land in our blocks, before vLLM gets the blocks back; the staging ranges
            # stay out of use until the reads stop (or a grace period after the disconnect).
            self._disconnect_unstopped(inf)
            return "failed"
        return None

    def _disconnect_unstopped(self, inf: _Inflight) -> None:
        # A scatter still running on the device is no read: disconnecting cannot stop it.
        keys = sorted({key for h, key in zip(inf.handles, inf.handle_nodes)
                       if h is not _NOT_POSTED and not isinstance(h, ScatterHandle) and not self._handle_stopped(h)})
        if not keys:  # only scatters on the device are still running: nothing to disconnect
            log.error("pdxfer: the scatter from staging for %s on %s has not completed %.0f s after the load "
                      "failed (%s); reporting the load failed: its blocks may still be written by it, its staging "
                      "stays out of use until it completes", inf.spec.req_id,
                      self._staging.device if self._staging is not None else "?", self._stop_bound_s, inf.error)
            return
        self.stats.reads_unstopped += len(keys)
        failed = []
        for key in keys:
            with self._peers_lock:
                cached = self._peers.pop(key, None)
            if cached is None:
                continue  # already dropped by another load: its disconnect ran
            try:
                self.transport.disconnect(cached[1])
            except Exception as exc:
                failed.append(f"{key[0]} rank {key[1]}: {exc}")
        log.error("pdxfer: read(s) for %s from holder(s) %s have not stopped %.0f s after the load failed (%s); "
                  "%s, reporting the load failed (a later load reconnects)", inf.spec.req_id,
                  ", ".join("%s rank %d" % k for k in keys), self._stop_bound_s, inf.error,
                  "disconnected them so no more bytes can land" if not failed else
                  f"disconnecting failed ({'; '.join(failed)}): its blocks may still receive bytes, its "
                  "staging stays out of use until the reads stop")
        inf.unstopped = keys if not failed else []

    def _progress(self, inf: _Inflight, delay: float | None) -> str | None:
        """"done" when every read finished; sets ``inf.error`` when the load cannot succeed."""
        elapsed = time.monotonic() - inf.started
        if inf.pending and not self._post_pending(inf):
            if inf.error is None and (elapsed > self._connect_bound() or self._past_load_bound(inf)):
                # A frozen or unreachable holder at first contact costs this bound, then a re-pull
                # from another holder or a recompute.
                inf.error = f"no connection to the holder after {elapsed:.2f} s"
                inf.blame |= {p[0].node_id for p in inf.pending}
                inf.unposted |= inf.blame
                inf.pending = []  # nothing may be posted for this load any more
            return None
        if inf.error is not None or (delay is not None and elapsed < delay):
            return None
        states = []
        for h in inf.handles:
            try:
                states.append(h.poll())
            except Exception as exc:
                inf.error = f"{type(exc).__name__}: {exc}"
                return None
        if any(s in (ReadState.FAILED, ReadState.CANCELLED) for s in states):
            errs = [h.error for h in inf.handles if h.error is not None]
            inf.error = str(errs[0]) if errs else "read failed"
            return None
        if inf.staged:  # scatter the staged pieces that landed, post the next ones
            moved = self._advance_streams(inf)
            if inf.error is not None:
                return None
            states = [h.poll() for h in inf.handles]
        else:
            moved = True
        if moved and all(s is ReadState.DONE for s in states):
            return "done"
        if any(s is ReadState.PENDING for s in states) and (time.monotonic() > inf.read_deadline
                                                            or self._past_load_bound(inf)):
            inf.blame |= {key[0] for h, key in zip(inf.handles, inf.handle_nodes)
                          if h is not _NOT_POSTED and not isinstance(h, ScatterHandle) and not self._handle_stopped(h)}
            inf.error = (f"read still pending after {time.monotonic() - inf.started:.2f} s, past its bound "
                         f"(the holder is frozen or much slower than it was)")
        return None

    def _cancel(self, inf: _Inflight) -> None:
        """Ask every read to stop; non-blocking (the step path must not wait on a transport)."""
        if inf.cancelled:
            return
        inf.cancelled = True
        for h in inf.handles:
            try:
                h.cancel()
            except Exception as exc:
                log.debug("pdxfer: cancel of a read for %s: %s", inf.spec.req_id, exc)

    @staticmethod
    def _handle_stopped(h: ReadHandle) -> bool:
        try:
            return h.poll() is not ReadState.PENDING
        except Exception:
            return False

    @classmethod
    def _stopped(cls, inf: _Inflight) -> bool:
        """True once no read of this load can write into its blocks any more."""
        return all(h is _NOT_POSTED or cls._handle_stopped(h) for h in inf.handles)

    def _connect_bound(self) -> float:
        return min(self.cfg.connect_timeout_s, self.cfg.load_timeout_s)

    def _read_bound(self, node_id: str, nbytes: int) -> float:
        """How long a read of ``nbytes`` from this holder may take before it is given up."""
        bw = self._bandwidth.get(node_id, _ASSUMED_BANDWIDTH)
        return min(self.cfg.load_timeout_s, self.cfg.read_timeout_floor_s + 4.0 * nbytes / bw)

    def _observe(self, inf: _Inflight, elapsed: float) -> None:
        """Remember each holder's bandwidth as loads saw it (posting to validation: slow steps
        count too, which keeps the bound generous)."""
        if elapsed <= 0 or inf.nbytes <= 0:
            return
        seen = inf.nbytes / elapsed
        for node_id in {node for node, _ in inf.handle_nodes}:
            old = self._bandwidth.get(node_id)
            self._bandwidth[node_id] = seen if old is None else 0.7 * old + 0.3 * seen

    def _conclude(self, inf: _Inflight, valid: bool, errors: set[int] | None = None) -> None:
        """Count and log a load that ended; a load not validated at the master fails its blocks.
        Its staging ranges are free again, unless a read may still land in them (quarantined)."""
        if inf.staged and self._staging is not None:
            if self._stopped(inf):
                self._staging.release(inf.staged)
            else:
                held = self._staging.quarantine(
                    inf.staged, [h for h in inf.handles if h is not _NOT_POSTED], bool(inf.unstopped),
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
        if inf.error is None and valid and not inf.lost:
            self.stats.loads_ok += counts
            self.stats.tokens_loaded += inf.load_tokens * counts
            if inf.host_reads:
                self.stats.host_tier_tokens_loaded += inf.load_tokens * counts
            self.stats.bytes_loaded += inf.nbytes
            self.stats.transfer_s.append(time.monotonic() - inf.load_started)
            self._observe(inf, elapsed)
            log.info("pdxfer: loaded %d tokens (%.1f MiB) for %s in %.2f ms%s", inf.load_tokens,
                     inf.nbytes / 2**20, spec.req_id, (time.monotonic() - inf.load_started) * 1e3,
                     f" ({inf.repulled} chunk(s) re-pulled)" if inf.repulled else "")
            return
        self.stats.loads_failed += 1
        if inf.error is None and valid:  # re-pulled, but blocks past what the other holders had are lost
            self._load_errors |= inf.lost
            log.warning("pdxfer: load for %s re-pulled %d chunk(s); %d block(s) are recomputed", spec.req_id,
                        inf.repulled, len(inf.lost))
            return
        self._load_errors |= errors if errors is not None else spec.local_blocks | inf.lost
        log.warning("pdxfer: load of %d tokens for %s failed (%s); recomputing", spec.num_tokens,
                    spec.req_id, inf.error)

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        for inf in self._inflight.values():
            self._cancel(inf)
        self._inflight.clear()
        self._connect_pool.shutdown(wait=False, cancel_futures=True)
        self._releaser.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception as exc:
                log.debug("pdxfer: transport close: %s", exc)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
