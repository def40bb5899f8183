"""Posting and following one load's reads on a worker rank: straight into place, or staged
and scattered piece by piece (another block size, format or head split), each tier of a holder
by its own planner; every read bounded by what its holder's earlier loads achieved.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.planning.convert import ConvertingPlanner
from pdxfer.planning.peer_plan import PeerPlanner
from pdxfer.transport.base import PeerDied, PeerUnreachable, ReadState
from pdxfer.vllm.holder_routes import NotReadable, Route
from pdxfer.vllm.load_plan import split_by_tier
from pdxfer.vllm.metadata import HolderRef
from pdxfer.vllm.worker.load import NOT_POSTED, Load, LoadPhase
from pdxfer.vllm.worker.peers import HolderPeers
from pdxfer.vllm.worker.staging import ReaderStaging, ScatterHandle, StagingFull, StagingTooSmall
from pdxfer.vllm.worker.worker_stats import WorkerStats

log = logging.getLogger("pdxfer.vllm.worker")

# Until a holder's first load is seen: low for any transport pdxfer runs on, so the first read's
# bound is generous (4 MiB -> 0.5 s + 0.34 s).
_ASSUMED_BANDWIDTH = 50e6


def past_load_bound(inf: Load, load_timeout_s: float) -> bool:
    """A re-pull round lives within its load's load_timeout_s, counted from the first post."""
    return inf.rounds > 0 and time.monotonic() > inf.load_started + load_timeout_s


class LoadReads:
    """The reads of every load of one reader rank. Usable once :meth:`attach` gave it the
    registered transport and staging area."""

    def __init__(self, cfg: ConnectorConfig, peers: HolderPeers, stats: WorkerStats):
        self.cfg = cfg
        self.peers = peers
        self.stats = stats
        self.transport: Any = None
        self.staging: ReaderStaging | None = None
        self._bandwidth: dict[str, float] = {}  # holder node -> bytes/s its loads achieved

    def attach(self, transport: Any, staging: ReaderStaging) -> None:
        self.transport, self.staging = transport, staging

    def post_all(self, inf: Load, nodes: Mapping[str, HolderRef]) -> None:
        """Post every read of ``inf``'s spec, or queue it until its holder rank is connected."""
        spec = inf.spec
        for i, r in enumerate(spec.reads):
            ref = nodes[r.node_id]
            try:
                my_routes = self.peers.routes_to(ref)
            except NotReadable as exc:  # the scheduler thought otherwise: never read wrong bytes
                inf.error = str(exc)
                return
            # One read per holder rank holding some of this rank's heads (TP: several, or a
            # slice of one); the load is loaded only when all of them finished.
            for route in my_routes:
                if self.peers.connected(ref, route):
                    self.post_read(inf, ref, route, r)
                else:
                    # Connecting to a new holder (a NIXL agent takes ~0.2 s here) happens off the
                    # step path; the read is posted from get_finished once the connection is up.
                    self.peers.start_connect(ref, route)
                    inf.pending.append((ref, route, r))
                if inf.error is not None:
                    inf.unposted |= {x.node_id for x in spec.reads[i:]}
                    return

    def post_read(self, inf: Load, ref: HolderRef, route: Route, r: Any) -> None:
        assert self.transport is not None
        try:
            at, peer, planner = self.peers.connections[(ref.node_id, route.holder_rank)]
            if at != ref.endpoint(route.holder_rank).transport_metadata:  # reconnected for another load's lookup
                raise RuntimeError(f"holder {ref.node_id} rank {route.holder_rank} is connected as another registration")
            host = self.peers.host_planners.get((ref.node_id, route.holder_rank))
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

    def _post_direct(self, inf: Load, ref: HolderRef, route: Route, planner: PeerPlanner, r: Any,
                     peer: str) -> None:
        """One transport read of ``r``'s block pairs straight into place."""
        plan = planner.plan(list(r.remote_blocks), list(r.local_blocks))
        inf.nbytes += plan.total_bytes
        inf.handles.append(self.transport.read(peer, plan))
        inf.handle_nodes.append((ref.node_id, route.holder_rank))
        bound = self.read_bound(ref.node_id, plan.total_bytes)
        inf.read_deadline = max(inf.read_deadline, time.monotonic() + bound)

    def _post_stream(self, inf: Load, ref: HolderRef, route: Route, planner: ConvertingPlanner, r: Any,
                     peer: str) -> None:
        """A staged read of ``r``: its pieces are posted as the staging area has room."""
        assert self.staging is not None
        stream = self.staging.stream(planner, r, peer)
        inf.staged.append(stream)
        inf.stream_slots.append(len(inf.handles))
        inf.handles.append(NOT_POSTED)
        inf.handle_nodes.append((ref.node_id, route.holder_rank))
        self._post_piece(inf, len(inf.staged) - 1)

    def _post_host_read(self, inf: Load, ref: HolderRef, route: Route, r: Any, peer: str,
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

    def _post_piece(self, inf: Load, i: int) -> None:
        """Post stream ``i``'s next piece if the staging area has room; else wait (bounded by
        the load's own bound), then fail naming the sizes."""
        assert self.staging is not None
        s = inf.staged[i]
        job = self.staging.next_piece(s)
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
                    f"use {self.staging.area.in_use} of its {self.staging.nbytes} bytes; raise staging_mib "
                    f"or staging_max_mib")
            return
        s.waiting_since = 0.0
        try:
            handle = self.transport.read(s.peer, job.plan)
        except Exception:
            self.staging.release([s])  # nothing was posted into it
            raise
        inf.handles[inf.stream_slots[i]] = handle
        inf.nbytes += job.plan.total_bytes
        node = inf.handle_nodes[inf.stream_slots[i]][0]
        inf.read_deadline = max(inf.read_deadline, now + self.read_bound(node, job.plan.total_bytes))

    def _advance_streams(self, inf: Load) -> bool:
        """Scatter every staged piece that landed and post the next one; True once every stream
        moved all its pieces. Sets ``inf.error`` when a piece cannot be scattered or posted."""
        assert self.staging is not None
        done = True
        for i, s in enumerate(inf.staged):
            slot = inf.stream_slots[i]
            h = inf.handles[slot]
            if s.job is not None and h is not NOT_POSTED:
                if h.poll() is not ReadState.DONE:  # the read, or the scatter after it, still runs
                    done = False
                    continue
                try:
                    if s.scatter_event is None and not self.staging.start_scatter(s).query():
                        # Enqueued on the worker's stream: the range is freed, and the load can
                        # finish, only once the event after it completed (seen in a later step).
                        inf.handles[slot] = ScatterHandle(s.scatter_event, self.staging.device)
                        inf.read_deadline = max(inf.read_deadline, time.monotonic() + self.cfg.load_timeout_s)
                        done = False
                        continue
                    self.staging.finish_scatter(s)
                except Exception as exc:
                    if s.scatter_event is not None and not isinstance(inf.handles[slot], ScatterHandle):
                        inf.handles[slot] = ScatterHandle(s.scatter_event, self.staging.device)  # wait for it
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

    def post_pending(self, inf: Load) -> bool:
        """Post reads whose connection came up; False while some connection is still pending."""
        still = []
        for ref, route, r in inf.pending:
            key = (ref.node_id, route.holder_rank)
            fut = self.peers.connect_future(key)
            if fut is None or not fut.done():
                if fut is None:
                    self.peers.start_connect(ref, route)
                still.append((ref, route, r))
                continue
            exc = fut.exception()
            if exc is not None:
                inf.error = (f"cannot connect to holder {ref.node_id} rank {route.holder_rank}: "
                             f"{type(exc).__name__}: {exc}")
                self.peers.forget_connect(key)  # a later load may try again
                inf.blame.add(ref.node_id)
                inf.unposted |= {p[0].node_id for p in inf.pending}
                inf.pending = []
                return True
            if not self.peers.connected(ref, route):  # that connect was for older metadata of this node
                self.peers.forget_connect(key)
                self.peers.start_connect(ref, route)
                still.append((ref, route, r))
                continue
            self.post_read(inf, ref, route, r)
            if inf.error is not None:
                inf.unposted |= {p[0].node_id for p in inf.pending}
                inf.pending = []
                return True
        inf.pending = still
        if not still:
            inf.enter(LoadPhase.READING)
        return not still

    def progress(self, inf: Load, delay: float | None) -> str | None:
        """"done" when every read finished; sets ``inf.error`` when the load cannot succeed."""
        elapsed = time.monotonic() - inf.started
        if inf.pending and not self.post_pending(inf):
            if inf.error is None and (elapsed > self.peers.connect_bound()
                                      or past_load_bound(inf, self.cfg.load_timeout_s)):
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
                                                            or past_load_bound(inf, self.cfg.load_timeout_s)):
            inf.blame |= {node for node, _ in inf.running_reads()}
            inf.error = (f"read still pending after {time.monotonic() - inf.started:.2f} s, past its bound "
                         f"(the holder is frozen or much slower than it was)")
        return None

    def cancel(self, inf: Load) -> None:
        """Ask every read to stop; non-blocking (the step path must not wait on a transport)."""
        if inf.cancelled:
            return
        inf.cancelled = True
        for h in inf.handles:
            try:
                h.cancel()
            except Exception as exc:
                log.debug("pdxfer: cancel of a read for %s: %s", inf.spec.req_id, exc)

    def read_bound(self, node_id: str, nbytes: int) -> float:
        """How long a read of ``nbytes`` from this holder may take before it is given up."""
        bw = self._bandwidth.get(node_id, _ASSUMED_BANDWIDTH)
        return min(self.cfg.load_timeout_s, self.cfg.read_timeout_floor_s + 4.0 * nbytes / bw)

    def observe(self, inf: Load, elapsed: float) -> None:
        """Remember each holder's bandwidth as loads saw it (posting to validation: slow steps
        count too, which keeps the bound generous)."""
        if elapsed <= 0 or inf.nbytes <= 0:
            return
        seen = inf.nbytes / elapsed
        for node_id in {node for node, _ in inf.handle_nodes}:
            old = self._bandwidth.get(node_id)
            self._bandwidth[node_id] = seen if old is None else 0.7 * old + 0.3 * seen
