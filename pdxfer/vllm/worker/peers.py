"""A reader rank's connections to holder ranks: which of a holder's ranks and heads it reads
(routes, decided once per holder and what it announced), connecting off the step path, the
planner made once per connection, and dropping a connection whose holder left.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdxfer.common.bounded_cache import ClearWhenFullCache
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.kv.layout import KVLayout
from pdxfer.kv.tiers import HOST_LAYOUT_KEY
from pdxfer.planning.convert import ConvertingPlanner
from pdxfer.planning.peer_plan import PeerPlanner
from pdxfer.vllm.holder_routes import NotReadable, Route, holder_route_key, holder_total_heads, layouts_of, routes
from pdxfer.vllm.metadata import HolderRef
from pdxfer.vllm.worker.staging import ReaderStaging

log = logging.getLogger("pdxfer.vllm.worker")

Planner = PeerPlanner | ConvertingPlanner
PeerKey = tuple[str, int]  # (holder node, holder rank)

# Holders come and go over a long life: past this many (holder, announcement) pairs the route
# cache starts over rather than grow.
_MAX_ROUTES = 1024


class HolderPeers:
    """Connections of one reader rank. Usable once :meth:`attach` gave it the registered KV."""

    def __init__(self, cfg: ConnectorConfig, *, rank: int, tp_size: int):
        self.cfg = cfg
        self.rank = rank
        self.tp_size = tp_size
        self.layout: KVLayout | None = None
        self.transport: Any = None
        self.staging: ReaderStaging | None = None
        self.total_kv_heads = 0
        # (node, holder rank) -> (its metadata, transport peer id, planner made once at connect)
        self.connections: dict[PeerKey, tuple[bytes, str, Planner]] = {}
        # (node, holder rank) -> (planner for its host slots, its device block count)
        self.host_planners: dict[PeerKey, tuple[Planner, int]] = {}
        self._lock = threading.Lock()
        self._connecting: dict[PeerKey, Future] = {}
        # holder (node id, what it announced) -> this rank's routes to it, or why it cannot read it
        self._routes: ClearWhenFullCache[tuple[str, str], list[Route] | str] = ClearWhenFullCache(_MAX_ROUTES)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdxfer-connect")

    def attach(self, layout: KVLayout, transport: Any, staging: ReaderStaging, total_kv_heads: int) -> None:
        self.layout, self.transport, self.staging, self.total_kv_heads = layout, transport, staging, total_kv_heads

    def routes_to(self, ref: HolderRef) -> list[Route]:
        """This rank's reads from holder ``ref`` (decided once per holder and what it announced)."""
        got = self._routes.get_or_make(holder_route_key(ref, lambda e: e.transport_metadata),
                                       lambda: self._decide_routes(ref))
        if isinstance(got, str):
            raise NotReadable(got)
        return got

    def _decide_routes(self, ref: HolderRef) -> list[Route] | str:
        assert self.layout is not None
        try:
            layouts = layouts_of(ref.endpoints)
            total = holder_total_heads(ref.total_kv_heads, len(layouts), layouts[0])
            return routes(ref.node_id, layouts, total, self.layout, self.tp_size, self.rank,
                          self.total_kv_heads or self.layout.kv_heads * self.tp_size,
                          staging=self.staging is not None and self.staging.enabled,
                          chunk_tokens=self.cfg.chunk_tokens)
        except NotReadable as exc:
            return str(exc)

    def readable(self, ref: HolderRef, own_node: str) -> bool:
        """Whether this rank could read holder ``ref`` at all (another node, same transport, a route)."""
        if ref.transport != self.cfg.transport or ref.node_id == own_node:
            return False
        try:
            self.routes_to(ref)
            return True
        except NotReadable:
            return False

    def connected(self, ref: HolderRef, route: Route) -> bool:
        with self._lock:
            cached = self.connections.get((ref.node_id, route.holder_rank))
        return cached is not None and cached[0] == ref.endpoint(route.holder_rank).transport_metadata

    def start_connect(self, ref: HolderRef, route: Route) -> None:
        key = (ref.node_id, route.holder_rank)
        fut = self._connecting.get(key)
        if fut is not None and not fut.done():
            return  # under way (perhaps to older metadata: the caller checks and retries)
        self._connecting[key] = self._pool.submit(self._connect, ref, route)

    def connect_future(self, key: PeerKey) -> Future | None:
        return self._connecting.get(key)

    def forget_connect(self, key: PeerKey) -> None:
        """A later load starts its own connect (this one failed, or was for older metadata)."""
        self._connecting.pop(key, None)

    def _connect(self, ref: HolderRef, route: Route) -> None:
        if ref.transport != self.cfg.transport:
            raise RuntimeError(f"holder {ref.node_id} uses transport {ref.transport}, this node {self.cfg.transport}")
        key = (ref.node_id, route.holder_rank)
        ep = ref.endpoint(route.holder_rank)
        with self._lock:
            cached = self.connections.get(key)
        if cached is not None and cached[0] == ep.transport_metadata:
            return
        if cached is not None:  # the node restarted with new metadata
            try:
                self.transport.disconnect(cached[1])
            except Exception:
                pass
        assert self.layout is not None and self.staging is not None
        # The holder rank's layout is checked against ours once, here, not on every read.
        planner = self.staging.planner_for(KVLayout.from_wire(ep.layout), route)
        host_wire = ep.layout.get(HOST_LAYOUT_KEY)
        host = None
        if host_wire is not None:
            host = (self.staging.planner_for(KVLayout.from_wire(host_wire), route), int(ep.layout["num_blocks"]))
        peer = self.transport.connect(ep.transport_metadata, timeout=self.connect_bound())
        with self._lock:
            self.connections[key] = (ep.transport_metadata, peer, planner)
            if host is not None:
                self.host_planners[key] = host
            else:
                self.host_planners.pop(key, None)

    def connect_bound(self) -> float:
        return min(self.cfg.connect_timeout_s, self.cfg.load_timeout_s)

    def disconnect(self, key: PeerKey) -> tuple[bool, Exception | None]:
        """Forget the connection to ``key`` and close it: (whether there was one, the close's error)."""
        with self._lock:
            cached = self.connections.pop(key, None)
        if cached is None:
            return False, None
        try:
            self.transport.disconnect(cached[1])
        except Exception as exc:
            return True, exc
        return True, None

    def connected_holders(self) -> list[str]:
        """Holder node ids this reader keeps a transport connection to (to any of their ranks)."""
        with self._lock:
            return sorted({node for node, _ in self.connections})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
