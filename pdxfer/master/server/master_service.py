"""The pdxfer-master service: the wire protocol server around the in-memory chunk index.

One asyncio event loop owns the index, so every request is applied atomically in arrival order.
Request and reply fields are decoded and encoded by ``protocol_ops.py``; stats are in
``service_stats.py``, the Prometheus metrics in ``metrics_export.py``; the process (flags, signals) is ``cli.py``,
started by ``service.py`` (the entry points).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from typing import Any, Callable

from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops
from pdxfer.master.server.conn import MasterConnection
from pdxfer.master.server.conn_slots import DEFAULT_MAX_UNPROVEN_PER_PEER, ConnSlots
from pdxfer.master.backends.coordinator import Coordinator, Standalone
from pdxfer.master.server.httpd import serve_http
from pdxfer.master.wire.tls import ServerTls
from pdxfer.master.server.index import (
    ChunkIndex,
    FencedError,
    SupersededError,
    UnknownNodeError,
)
from pdxfer.master.server.metrics_export import MasterMetrics, scrape_values
from pdxfer.master.server.service_stats import health, stats, status_reply
from pdxfer.kv.tiers import host_block_base

log = logging.getLogger("pdxfer.master")

DEFAULT_MAX_LOCK_TTL_S = 30.0  # announced in register replies; readers asking for more get this
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0  # a new connection's first frame (hello) must arrive within this
DEFAULT_IDLE_TIMEOUT_S = 600.0  # an authenticated connection idle this long is closed (clients reconnect)
_REFUSAL_LOG_EVERY_S = 10.0


class MasterService:
    def __init__(
        self,
        token: str | None = None,
        coordinator: Coordinator | None = None,
        chunk_tokens: int = 256,
        max_entries: int = 10_000_000,
        reap_interval_s: float = 0.1,
        max_lock_ttl_s: float = DEFAULT_MAX_LOCK_TTL_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_unproven_per_peer: int = DEFAULT_MAX_UNPROVEN_PER_PEER,
    ) -> None:
        if max_connections < 1 or handshake_timeout_s <= 0 or idle_timeout_s <= 0:
            raise ValueError(f"max_connections ({max_connections}), handshake_timeout_s ({handshake_timeout_s}) "
                             f"and idle_timeout_s ({idle_timeout_s}) must be positive")
        # A peer must not be able to stop the master: connections are capped, and every wait for a
        # peer's bytes is bounded (issue 9, hole 9).
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.connections_refused = 0
        self.handshake_timeouts = 0
        self.unproven_evicted = 0
        self.http_connections_cut = 0  # HTTP connections cut at the HTTP port's cap (httpd.py)
        self._refusal_logged_at = -_REFUSAL_LOG_EVERY_S
        self._eviction_logged_at = -_REFUSAL_LOG_EVERY_S
        # Unproven connections never crowd out clients that proved themselves (conn_slots.py).
        self._slots: ConnSlots[MasterConnection] = ConnSlots(max_connections, max_unproven_per_peer)
        if not ops.MIN_LOCK_TTL_S <= max_lock_ttl_s <= ops.MAX_TTL_S:
            raise ValueError(f"max_lock_ttl_s must be in [{ops.MIN_LOCK_TTL_S}, {ops.MAX_TTL_S}], got {max_lock_ttl_s}")
        # Holders force-free a refused key after this bound (plus their lease): no lock may outlive it.
        self.max_lock_ttl_s = float(max_lock_ttl_s)
        self.token = token.encode() if token else None
        self.index = ChunkIndex(max_entries=max_entries)
        self.coord = coordinator or Standalone()
        self.coord.on_become_leader = self._became_leader
        self.coord.on_lose_leader = self._lost_leader
        self.index.on_node_dropped = lambda nid, why: self.coord.node_dropped(nid)
        # The etcd coordinator re-mirrors current members after it lost its etcd state.
        self.coord.members = lambda: [(nid, n.ttl, n.info_json) for nid, n in self.index.nodes.items()]
        self.chunk_tokens = chunk_tokens
        self.reap_interval_s = reap_interval_s
        self.started = time.time()
        self.auth_failures = 0
        self.bad_frames = 0
        self.lookup_seconds = 0.0
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._conns: set[MasterConnection] = set()
        self.port = 0
        self.http_port = 0
        self.require_client_cert = False  # set by start(): TLS with a client CA
        self.tls_refusals = 0
        self._handlers: dict[int, Callable[[dict[str, Any], memoryview, float], Any]] = {
            P.OP_LOOKUP: self._lookup, P.OP_RELEASE: self._release, P.OP_PUBLISH: self._publish,
            P.OP_UNPUBLISH: self._unpublish, P.OP_HEARTBEAT: self._heartbeat, P.OP_REGISTER: self._register,
            P.OP_DEREGISTER: self._deregister, P.OP_STATS: self._stats, P.OP_PING: self._ping,
            P.OP_FENCE: self._fence, P.OP_PEEK: self._peek, P.OP_NODES: self._nodes,
            P.OP_STATUS: self._status,
        }
        self.metrics = MasterMetrics(lambda: scrape_values(self), {op: P.OP_NAMES[op] for op in self._handlers})

    # ---- leadership -----------------------------------------------------------------------------

    def _became_leader(self) -> None:
        log.info("serving as leader (%s store)", self.coord.kind)

    def _lost_leader(self) -> None:
        # Whatever we knew may already be wrong under the new leader: forget it, and drop clients
        # so they reconnect to whoever leads now.
        log.warning("lost leadership: clearing the index and closing client connections")
        self.index.clear()
        for conn in list(self._conns):
            conn.close()

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, host: str, port: int, http_host: str | None, http_port: int, advertise: str | None,
                    tls: ServerTls | None = None, http_tls: bool = True) -> None:
        """Serve the wire (and HTTP unless ``http_port`` < 0) ports; with ``tls`` the wire port
        serves TLS (client certificates required when it names a client CA), and so does the HTTP
        port when ``http_tls``, without asking for client certificates: health probes and scrapers
        seldom have one, and it serves nothing a client could change."""
        loop = asyncio.get_running_loop()
        ctx = tls.context(require_client_cert="reply") if tls is not None else None
        self.require_client_cert = bool(tls is not None and tls.client_ca_file)
        # A TLS handshake is part of the first frame's budget: a peer that stalls in it is dropped too.
        server = await loop.create_server(lambda: MasterConnection(self), host, port, ssl=ctx,
                                          ssl_handshake_timeout=self.handshake_timeout_s if ctx else None)
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        if http_port >= 0:
            hctx = tls.context(require_client_cert=False) if tls is not None and http_tls else None
            hs = await serve_http(http_host or host, http_port, self.metrics.render,
                                  lambda: health(self), ssl_context=hctx, on_cut=self._http_cut)
            self._servers.append(hs)
            self.http_port = hs.sockets[0].getsockname()[1]
        self._tasks.append(asyncio.create_task(self._reaper()))
        await self.coord.start(advertise or f"{host}:{self.port}")

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self._servers:
            s.close()
        for conn in list(self._conns):
            conn.close()
        await self.coord.stop()

    async def _reaper(self) -> None:
        last_freeze = time.monotonic()
        while True:
            await asyncio.sleep(self.reap_interval_s)
            now = time.monotonic()
            self.index.expire(now)
            if now - last_freeze >= 5.0:
                # Move long-lived objects (the index: millions of entries) out of the cyclic GC's
                # reach, so a full collection never scans them (~0.75 s per million entries here,
                # a lookup p99 spike). Index objects are freed by reference counting: the only
                # cycle (node <-> its entries) is broken explicitly when a node is dropped.
                gc.freeze()
                last_freeze = now

    # ---- connections ----------------------------------------------------------------------------

    def _refuse_connection(self, peer: Any, transport: asyncio.BaseTransport) -> None:
        self.connections_refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= _REFUSAL_LOG_EVERY_S:  # one line per burst, not per peer
            self._refusal_logged_at = now
            log.warning("connection limit of %d reached (--max-connections): refused %s (%d refused so far)",
                        self.max_connections, peer, self.connections_refused)
        transport.close()

    def _http_cut(self) -> None:
        self.http_connections_cut += 1

    def _evict_unproven(self, conn: MasterConnection, newcomer: Any) -> None:
        """Cut an unproven connection to make room for ``newcomer`` (one log line per burst)."""
        self.unproven_evicted += 1
        now = time.monotonic()
        if now - self._eviction_logged_at >= _REFUSAL_LOG_EVERY_S:
            self._eviction_logged_at = now
            log.warning("cut %s, a connection that had not proven itself (no accepted hello or request), to "
                        "make room for %s (--max-connections %d; %d cut so far)", conn.peer, newcomer,
                        self.max_connections, self.unproven_evicted)
        conn.close()

    def _check_preauth(self, hdr: P.Header, peer: Any) -> None:
        """Before a connection has authenticated: a small hello, nothing else (body not read)."""
        if hdr.op != P.OP_HELLO:
            self.auth_failures += 1
            log.warning("refused %s request from %s: missing token (no hello on this connection)",
                        P.OP_NAMES.get(hdr.op, hdr.op), peer)
            raise P.ProtocolError(P.ERR_AUTH, "missing token: the first frame of a connection must be a hello "
                                  "carrying the token")
        if hdr.json_len + hdr.blob_len > P.MAX_PREAUTH_BYTES:
            raise P.ProtocolError(P.ERR_OVERSIZED, f"hello of {hdr.json_len + hdr.blob_len} bytes exceeds "
                                  f"{P.MAX_PREAUTH_BYTES}")

    def _hello(self, hdr: P.Header, body: bytes, peer: Any) -> tuple[bytes, bool]:
        """(reply, authenticated): a wrong or missing token is answered, counted, logged, and the
        connection closed."""
        try:
            tok = ops.decode_hello(P.decode_json(body[: hdr.json_len]), b"")
        except P.ProtocolError as exc:
            self.bad_frames += 1
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": exc.code, "msg": str(exc)}), False
        if self.token is not None and (tok is None or not hmac.compare_digest(tok.encode(), self.token)):
            self.auth_failures += 1
            log.warning("refused hello from %s: %s token", peer, "missing" if tok is None else "wrong")
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_AUTH, "msg": "missing or wrong token"}), False
        return P.encode_frame(hdr.op | P.REPLY_BIT, hdr.req_id, {"ok": True}), True

    def _handle(self, hdr: P.Header, body: bytes, peer: Any) -> tuple[bytes, bool]:
        """One request -> (reply frame, keep the connection open)."""
        try:
            doc = P.decode_json(body[: hdr.json_len])  # the connection is authenticated (hello)
            if hdr.op not in (P.OP_STATS, P.OP_PING, P.OP_STATUS) and not self.coord.is_leader:
                leader = self.coord.leader_address
                raise P.ProtocolError(P.ERR_NOT_LEADER, "this master is not the leader (a standby, or a leader whose "
                                      f"lease may have expired); leader is {leader or 'unknown'}")
            out = self._dispatch(hdr.op, doc, memoryview(body)[hdr.json_len :])
            if isinstance(out, tuple):  # (pre-encoded JSON, blob) from the hot path
                body_json, blob_out = out
                head = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, hdr.op | P.REPLY_BIT, hdr.req_id,
                                     len(body_json), len(blob_out))
                return b"".join((head, body_json, blob_out)), True
            return P.encode_frame(hdr.op | P.REPLY_BIT, hdr.req_id, out), True
        except P.ProtocolError as exc:
            if exc.code not in (P.ERR_AUTH, P.ERR_NOT_LEADER):
                self.bad_frames += 1
                log.warning("refused request from %s: %s", peer, exc)
            err = {"err": exc.code, "msg": str(exc)}
            if exc.code == P.ERR_NOT_LEADER:
                err["leader"] = self.coord.leader_address
            return P.encode_frame(P.OP_ERROR, hdr.req_id, err), exc.code != P.ERR_AUTH
        except UnknownNodeError as exc:
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_UNKNOWN_NODE, "msg": str(exc)}), True
        except FencedError as exc:
            log.info("refused publish from %s: %s", peer, exc)
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_FENCED, "msg": str(exc)}), True
        except SupersededError as exc:
            log.warning("refused %s from %s: %s", P.OP_NAMES.get(hdr.op, hdr.op), peer, exc)
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_SUPERSEDED, "msg": str(exc)}), True
        except Exception as exc:  # a bug must not take the service down for everyone else
            log.exception("internal error on %s from %s", P.OP_NAMES.get(hdr.op, hdr.op), peer)
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_INTERNAL, "msg": repr(exc)}), False

    def _dispatch(self, op: int, doc: dict[str, Any], blob: memoryview) -> Any:
        handler = self._handlers.get(op)
        if handler is None:
            raise P.ProtocolError(P.ERR_UNKNOWN_OP, f"unknown op {op}")
        t0 = time.perf_counter()
        try:
            return handler(doc, blob, time.monotonic())
        finally:  # refused requests too: a slow refusal is still time the loop was busy
            self.metrics.observe[op](time.perf_counter() - t0)

    # ---- one handler per op: decode the request, apply it to the index, encode the reply --------

    def _lookup(self, doc: dict[str, Any], blob: memoryview, now: float) -> tuple[bytes, bytes]:
        t0 = time.perf_counter()
        req = ops.decode_lookup(doc, blob)
        ttl = min(req.ttl, self.max_lock_ttl_s)
        out = self.index.lookup_and_lock(req.keys, req.reader, ttl, now, req.parties, req.skip, req.transport,
                                         req.prefer_tier, joined=bytes(blob))
        nodes = ((nid, node.epoch, node.info_json) for nid, node in out.nodes.items())
        head = ops.encode_lookup_reply(out.lock_id, out.hit, ttl, out.runs, out.counts, nodes, req.have)
        self.lookup_seconds += time.perf_counter() - t0
        return head, out.blocks

    def _peek(self, doc: dict[str, Any], blob: memoryview, now: float) -> tuple[bytes, bytes]:
        req = ops.decode_peek(doc, blob)
        out = self.index.peek(req.keys, now, req.skip, req.transport)
        nodes = ((nid, node.epoch, node.info_json) for nid, node in out.nodes.items())
        return ops.encode_peek_reply(out.hit, out.prefix_by_node, nodes, req.have, out.device_prefix_by_node), b""

    def _nodes(self, doc: dict[str, Any], blob: memoryview, now: float) -> tuple[bytes, bytes]:
        return ops.encode_nodes_reply(n.info_json for n in self.index.live_nodes(now)), b""

    def _status(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        # Answered by a standby too (its node list is empty): it still says who leads.
        return status_reply(self, now)

    def _release(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        lock_id, all_parties = ops.decode_release(doc, blob)
        return ops.encode_release_reply(self.index.release(lock_id, now, all_parties))

    def _publish(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        req = ops.decode_publish(doc, blob)
        accepted = self.index.publish(req.node_id, req.items, req.retention_s, now, req.epoch, req.seq)
        return ops.encode_publish_reply(accepted)

    def _unpublish(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        req = ops.decode_unpublish(doc, blob)
        removed = self.index.unpublish_if_unlocked(req.node.node_id, req.keys, now, req.node.epoch, req.fence)
        return ops.encode_unpublish_reply(removed)

    def _fence(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        (node_id, epoch), upto = ops.decode_fence(doc, blob)
        return ops.encode_fence_reply(self.index.fence(node_id, upto, now, epoch))

    def _heartbeat(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        node_id, epoch = ops.decode_heartbeat(doc, blob)
        left = self.index.heartbeat(node_id, now, epoch)
        if left is not None:
            self.coord.node_heartbeat(node_id)
        return ops.encode_heartbeat_reply(left)

    def _register(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        req = ops.decode_register(doc, blob)
        epoch = self.index.register(req.node_id, "", req.ttl, now, req.transport, host_block_base(req.layout))
        info_json = ops.encode_node_description(req, epoch)
        self.index.nodes[req.node_id].info_json = info_json
        self.coord.node_registered(req.node_id, req.ttl, info_json)
        log.info("registered node %s (rank %d, %s, ttl %.1fs)", req.node_id, req.rank, req.transport, req.ttl)
        return ops.encode_register_reply(epoch, req.ttl, self.max_lock_ttl_s)

    def _deregister(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        node_id, epoch = ops.decode_deregister(doc, blob)
        return ops.encode_deregister_reply(self.index.deregister(node_id, epoch))

    def _stats(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        return self.stats()

    def _ping(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        return ops.encode_ping_reply(self.coord.is_leader, self.coord.leader_address)

    def stats(self) -> dict[str, Any]:
        return stats(self)
