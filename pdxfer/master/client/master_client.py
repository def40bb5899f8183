"""Synchronous pdxfer-master client: thread-safe, every wait bounded.

Each call takes a persistent TCP connection (master_conn.py) from a small pool (one per concurrent
caller), sends one frame and waits for its reply, so concurrent threads never wait on each other's
round trips. Every call finishes within ``timeout_s`` (plus at most a tenth of it, 50 ms at most:
the socket timeout follows the time left that closely) or raises ``MasterUnavailable``.

Addresses (see ``locator.py``): ``"host:port"`` of one master, or
``"etcd://host:port[,host:port]/prefix"``: the client reads the current leader from etcd and
follows leader changes: on a refused connection or a "not leader" answer it re-reads the leader
and retries within the same time budget.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops
from pdxfer.master.wire.errors import (
    MasterAuthError,
    MasterError,
    MasterProtocolError,
    MasterUnavailable,
    NotLeader,
    PublishFenced,
    RegistrationSuperseded,
    UnknownNode,
)
from pdxfer.master.client.locator import locator_for
from pdxfer.master.wire.tls import (
    CLIENT_ENV,
    MasterTlsError,
    client_tls_from,
    closed_after_handshake,
    explain_client_error,
)
from pdxfer.master.client.locations import ChunkLocations
from pdxfer.master.client.master_conn import MasterConn, PlainToTls, Unsendable, _Closed
from pdxfer.master.wire.records import LookupResult, NodeInfo, PeekResult, Registration
from pdxfer.master.client.registrations import SHARED, Registrations

log = logging.getLogger("pdxfer.master.client.master_client")

T = TypeVar("T")


# How far past its deadline a call may run (and at most a tenth of its timeout): the socket
# timeout follows the time left this closely.
_TIMEOUT_SLACK_S = 0.05


class _StaleNodeCache(Exception):
    pass


def _maybe_tls_hint(exc: BaseException) -> str:
    """A plain client's hello cut off by the master: say what a master serving TLS looks like."""
    if isinstance(exc, (_Closed, ConnectionResetError)):
        return (f" (if the master serves TLS, give ca_file / ${CLIENT_ENV['ca_file']}; a TLS master closes "
                "plain connections)")
    return ""


def _backoff(attempt: int, deadline: float) -> None:
    """Pause before the next try at finding the leader: longer each time, never past the deadline."""
    time.sleep(min(0.05 * (attempt + 1), max(deadline - time.monotonic(), 0)))


class MasterClient:
    """Every call finishes within ``timeout_s`` (plus at most a tenth of it, 50 ms at most) or
    raises a MasterError: MasterUnavailable when no master answered."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 2.0,
                 registrations: Registrations | None = None, *, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None,
                 server_name: str | None = None) -> None:
        """TLS towards the master (docs/master.md): ``ca_file`` (the CA that signed the master's
        certificate), ``cert_file``/``key_file`` (a client certificate, for a master that requires
        one), ``server_name`` (the name its certificate must carry; default: the host dialled);
        each falls back to its environment variable (``master_tls.CLIENT_ENV``). A leader found
        through etcd is reached with the same settings."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.tls = client_tls_from(ca_file, cert_file, key_file, server_name)
        self._ssl = self.tls.context() if self.tls is not None else None
        self.timeout_s = timeout_s
        self._slack = min(_TIMEOUT_SLACK_S, timeout_s / 10)
        self.token = token
        self._lock = threading.Lock()
        self._pool: list[MasterConn] = []
        self._closed = False
        # Node descriptions by (node id, epoch), and the epochs we tell the master we have.
        self._node_cache: dict[tuple[str, int], NodeInfo] = {}
        self._have: dict[str, int] = {}
        self._locator = locator_for(address)
        # This process's registrations (epochs) and publish sequence numbers, per node: shared by
        # the clients of one process unless given (registrations.py).
        self._regs = registrations if registrations is not None else SHARED
        self._master = str(self._locator)
        self._follows = self._locator.follows_leader
        self._addr: tuple[str, int] | None = None if self._follows else self._locator.locate(timeout_s)

    # ---- plumbing -------------------------------------------------------------------------------

    def _leader(self, deadline: float) -> tuple[str, int]:
        with self._lock:
            addr = self._addr
        if addr is not None:
            return addr
        addr = self._locator.locate(deadline - time.monotonic())
        with self._lock:
            self._addr = addr
        return addr

    def _forget_leader(self, addr: tuple[str, int]) -> None:
        if not self._follows:
            return
        with self._lock:
            if self._addr == addr:
                self._addr = None
            stale = [c for c in self._pool if c.addr == addr]
            self._pool = [c for c in self._pool if c.addr != addr]
        for c in stale:
            c.close()

    def _take(self, addr: tuple[str, int], deadline: float) -> MasterConn:
        with self._lock:
            if self._closed:
                raise MasterError("client is closed")
            while self._pool:
                c = self._pool.pop()
                if c.addr == addr:
                    return c
                c.close()
        try:
            conn = MasterConn(addr, deadline - time.monotonic(), self.tls, self._ssl, self._slack)
        except OSError as exc:
            why = explain_client_error("%s:%d" % addr, exc, self.tls)
            if why is not None:
                raise MasterTlsError(why) from None
            raise MasterUnavailable(f"cannot connect to master {addr[0]}:{addr[1]}: {exc}") from None
        if self.token is not None:
            self._hello(conn, deadline)
        return conn

    def _hello(self, conn: MasterConn, deadline: float) -> None:
        """Authenticate a new connection: its first frame carries the token (the master reads
        nothing else from it before)."""
        where = f"master {conn.addr[0]}:{conn.addr[1]}"
        try:
            rop, rdoc, _ = conn.request(*ops.encode_hello(self.token), deadline)
        except PlainToTls as exc:
            conn.close()
            raise MasterTlsError(f"hello to {where}: {exc}") from None
        except (OSError, _Closed) as exc:
            conn.close()
            why = explain_client_error(where[7:], exc, self.tls) if isinstance(exc, OSError) else None
            if why is None and self.tls is not None and isinstance(exc, (_Closed, ConnectionResetError)):
                why = closed_after_handshake(where[7:], self.tls)
            if why is not None:
                raise MasterTlsError(why) from None
            raise MasterUnavailable(f"hello to {where}: {exc!r}"
                                    + ("" if self.tls else _maybe_tls_hint(exc))) from None
        except P.ProtocolError as exc:
            conn.close()
            raise MasterProtocolError(f"bad hello reply from {where}: {exc}") from None
        if rop == P.OP_ERROR:
            conn.close()
            msg = f"hello to {where}: {rdoc.get('msg', rdoc.get('err'))}"
            raise MasterAuthError(msg) if rdoc.get("err") == P.ERR_AUTH else MasterProtocolError(msg)
        conn.used = False  # the hello was its first use: a request that finds it closed is not retried

    def _give(self, conn: MasterConn) -> None:
        with self._lock:
            if not self._closed and len(self._pool) < 64:
                self._pool.append(conn)
                return
        conn.close()

    def _call(self, req: ops.Request) -> tuple[dict[str, Any], bytes]:
        op, doc, blob = req
        deadline = time.monotonic() + self.timeout_s
        last = "no attempt"
        for attempt in itertools.count():
            if attempt and time.monotonic() >= deadline:
                raise MasterUnavailable(f"{P.OP_NAMES.get(op, op)}: no master answered within {self.timeout_s}s ({last})")
            addr = None
            try:
                addr = self._leader(deadline)
                conn = self._take(addr, deadline)
            except MasterTlsError:
                raise
            except MasterUnavailable as exc:
                last = str(exc)
                if not self._follows:
                    raise
                if addr is not None:
                    self._forget_leader(addr)  # refused: the leader we knew is gone; ask etcd again
                _backoff(attempt, deadline)
                continue
            reused = conn.used
            try:
                rop, rdoc, rblob = conn.request(op, doc, blob, deadline)
            except Unsendable as exc:
                self._give(conn)
                raise ValueError(str(exc)) from None
            except PlainToTls as exc:
                conn.close()
                raise MasterTlsError(f"{P.OP_NAMES.get(op, op)} to master {addr[0]}:{addr[1]}: {exc}") from None
            except (OSError, _Closed) as exc:
                conn.close()
                why = explain_client_error("%s:%d" % addr, exc, self.tls) if isinstance(exc, OSError) else None
                cut = isinstance(exc, (_Closed, ConnectionResetError))
                if why is None and self.tls is not None and not reused and cut:
                    why = closed_after_handshake("%s:%d" % addr, self.tls)
                if why is not None:
                    raise MasterTlsError(why) from None
                last = f"{addr[0]}:{addr[1]}: {exc!r}"
                if reused and not isinstance(exc, socket.timeout):
                    continue  # a pooled connection the master had closed: retry on a fresh one
                self._forget_leader(addr)
                if not self._follows or isinstance(exc, socket.timeout):
                    hint = "" if self.tls else _maybe_tls_hint(exc)
                    raise MasterUnavailable(f"{P.OP_NAMES.get(op, op)}: {last}{hint}") from None
                _backoff(attempt, deadline)
                continue
            except P.ProtocolError as exc:
                conn.close()
                raise MasterProtocolError(f"bad reply from master: {exc}") from None
            if rop == P.OP_ERROR:
                code = rdoc.get("err")
                msg = f"{P.OP_NAMES.get(op, op)}: {rdoc.get('msg', code)}"
                if code == P.ERR_AUTH:
                    conn.close()
                    raise MasterAuthError(msg)
                self._give(conn)
                if code == P.ERR_NOT_LEADER:
                    last = msg
                    self._forget_leader(addr)
                    if not self._follows:
                        raise NotLeader(msg)
                    _backoff(attempt, deadline)
                    continue
                if code == P.ERR_UNKNOWN_NODE:
                    raise UnknownNode(msg)
                if code == P.ERR_SUPERSEDED:
                    raise RegistrationSuperseded(msg)
                if code == P.ERR_FENCED:
                    raise PublishFenced(msg)
                if code == P.ERR_INTERNAL:
                    raise MasterError(msg)
                raise MasterProtocolError(msg)
            self._give(conn)
            if rop != op | P.REPLY_BIT:
                raise MasterProtocolError(f"reply op {rop} does not answer op {op}")
            return rdoc, rblob
        raise AssertionError("unreachable")

    # ---- API ------------------------------------------------------------------------------------

    def _ask(self, req: ops.Request, decode: Callable[..., T], *args: Any) -> T:
        """One request; its reply decoded (``decode(doc, blob, *args)``), a malformed reply
        turned into MasterProtocolError."""
        doc, blob = self._call(req)
        try:
            return decode(doc, blob, *args)
        except P.ProtocolError as exc:
            raise MasterProtocolError(f"bad {P.OP_NAMES.get(req.op, req.op)} reply from master: {exc}") from None

    def register_node(self, info: NodeInfo, lease_ttl_s: float = 10.0) -> Registration:
        """Register (or re-register: a new incarnation) the node. The returned registration says
        its epoch and the master's lock TTL cap (``max_lock_ttl_s``): no reader lock pins the
        node's entries longer, so a holder derives every force-free bound from it."""
        reg = self._ask(ops.encode_register(info, lease_ttl_s), ops.decode_register_reply, info.node_id)
        self._regs.put(self._master, reg)
        return reg

    def registration(self, node_id: str) -> Registration | None:
        """This process's current registration of the node at this master (None: none)."""
        return self._regs.get(self._master, node_id)

    # Calls of a node name its registration: ``epoch`` (default: this process's registration of the
    # node). RegistrationSuperseded when the node id was registered again since.

    def heartbeat(self, node_id: str, epoch: int | None = None) -> bool:
        """False: the master does not know the node (restart, failover, lease lost): re-register."""
        return self._ask(ops.encode_heartbeat(node_id, self._regs.epoch(self._master, node_id, epoch)),
                         ops.decode_heartbeat_reply)

    def deregister_node(self, node_id: str, epoch: int | None = None) -> None:
        epoch = self._regs.epoch(self._master, node_id, epoch)
        self._ask(ops.encode_deregister(node_id, epoch), ops.decode_deregister_reply)
        self._regs.forget(self._master, node_id, epoch)

    def publish(
        self, node_id: str, entries: Sequence[tuple[bytes, Sequence[int]]], retention_s: float | None = None,
        *, epoch: int | None = None, seq: int | None = None,
    ) -> int:
        """How many entries were accepted. ``seq``: this publish's sequence number (default: a new
        one from ``next_publish_seq``; a holder that queues publishes takes it when it queues, so a
        fence covers what is still queued). PublishFenced when ``seq`` is at or below the node's
        fence: nothing was applied (a batch of a large publish before the fence may have been)."""
        epoch = self._regs.epoch(self._master, node_id, epoch)
        if seq is None:
            seq = self._regs.next_seq(self._master, node_id)
        else:
            self._regs.saw_seq(self._master, node_id, seq)
        accepted = 0
        # Batches bounded well below the frame limits.
        step = 4096
        for start in range(0, len(entries), step):
            batch = entries[start : start + step]
            accepted += self._ask(ops.encode_publish(node_id, batch, retention_s, epoch, seq), ops.decode_publish_reply,
                                  len(batch))
        return accepted

    def lookup_and_lock(self, keys: Sequence[bytes], reader: str, lock_ttl_s: float = 10.0,
                        parties: int = 1, *, skip: Mapping[str, int] | None = None,
                        transport: str | None = None, prefer_tier: str | None = None) -> LookupResult:
        """The longest held prefix of ``keys``, locked. The lock's TTL is ``lock_ttl_s`` capped by
        the master's ``max_lock_ttl_s``: the result's ``lock_ttl_s`` is the one granted.
        ``parties``: how many ``release`` calls the lock waits for before its entries are
        unpinned (one per TP rank that reads under it; each release says whether the lock was
        valid when it arrived). ``skip`` (node id -> epoch; 0: every registration of the node) and
        ``transport``: holders this reader cannot use, never chosen (the result's ``epochs``
        names each holder's registration). ``prefer_tier`` (pdxfer.kv.tiers): where several
        holders hold a chunk, one holding it in this tier is chosen (the hit is as long either way)."""
        keys = list(keys)
        if not keys:
            return LookupResult(None, 0, [], {}, lock_ttl_s)
        joined = P.join_keys(keys)
        for attempt in range(2):
            with self._lock:
                have = dict(self._have) if attempt == 0 else {}
            reply = self._ask(ops.encode_lookup(joined, reader, lock_ttl_s, have, parties, dict(skip or {}), transport,
                                                prefer_tier),
                              ops.decode_lookup_reply, len(keys))
            try:
                nodes = {nid: self._node_from(nid, epoch, info) for nid, (epoch, info) in reply.nodes.items()}
            except _StaleNodeCache:
                # Another thread evicted a node description between request and reply: drop
                # this lock and ask again with the full descriptions.
                if reply.lock_id:
                    self.release(reply.lock_id, all_parties=True)
                continue
            locations = ChunkLocations(keys, reply) if reply.hit else []
            epochs = {nid: epoch for nid, (epoch, _) in reply.nodes.items()}
            return LookupResult(reply.lock_id, reply.hit, locations, nodes, reply.ttl, epochs)
        raise MasterProtocolError("lookup reply referenced node descriptions the client does not have")

    def peek(self, keys: Sequence[bytes], *, skip: Mapping[str, int] | None = None,
             transport: str | None = None) -> PeekResult:
        """Read-only: how many leading ``keys`` the live fleet holds (what ``lookup_and_lock``
        with the same ``skip`` and ``transport`` would hit now) and, per usable holder of key 0,
        how many leading keys it holds on its own. Nothing is locked or pinned: holders may
        unpublish right after, so a reader must still look up (and lock) before reading."""
        keys = list(keys)
        if not keys:
            return PeekResult(0, {}, {})
        joined = P.join_keys(keys)
        for attempt in range(2):
            with self._lock:
                have = dict(self._have) if attempt == 0 else {}
            reply = self._ask(ops.encode_peek(joined, have, dict(skip or {}), transport), ops.decode_peek_reply,
                              len(keys))
            try:
                nodes = {nid: self._node_from(nid, epoch, info) for nid, (epoch, info) in reply.nodes.items()}
            except _StaleNodeCache:
                continue  # evicted meanwhile (another thread): ask again with full descriptions
            return PeekResult(reply.hit, dict(reply.prefix_by_node), nodes, dict(reply.device_prefix_by_node))
        raise MasterProtocolError("peek reply referenced node descriptions the client does not have")

    def nodes(self) -> list[NodeInfo]:
        """The live registrations (read-only): each engine's description, including what a router
        needs (``serve_url``, ``namespace``, ``chunk_tokens``, ``role``; empty when not announced)."""
        return [info for _, info in self._ask(ops.encode_nodes(), ops.decode_nodes_reply)]

    def status(self) -> dict[str, Any]:
        """The master's leadership and every live node's holdings, locks and lease (read-only;
        the keys are listed in docs/master.md, "pdxfer status")."""
        return self._ask(ops.encode_status(), ops.decode_status_reply)

    def _node_from(self, nid: str, epoch: int, info: NodeInfo | None) -> NodeInfo:
        ck = (nid, epoch)
        if info is None:  # the master sent the epoch only: we told it we have this one
            cached = self._node_cache.get(ck)
            if cached is None:
                raise _StaleNodeCache(nid)
            return cached
        with self._lock:
            if len(self._node_cache) >= 1024:  # bounded: forget the older half
                for old in list(self._node_cache)[:512]:
                    del self._node_cache[old]
                    if self._have.get(old[0]) == old[1]:
                        del self._have[old[0]]
            self._node_cache[ck] = info
            if len(self._have) < 256 or nid in self._have:
                self._have[nid] = epoch
        return info

    def release(self, lock_id: str, all_parties: bool = False) -> bool:
        """One party's release (True: the lock was valid until now); ``all_parties``: give the
        whole lock back (nobody will read under it)."""
        return self._ask(ops.encode_release(lock_id, all_parties), ops.decode_release_reply)

    def next_publish_seq(self, node_id: str) -> int:
        """A new publish sequence number for the node (above all handed out in this process)."""
        return self._regs.next_seq(self._master, node_id)

    def last_publish_seq(self, node_id: str) -> int:
        """The newest publish sequence number handed out for the node in this process (0: none)."""
        return self._regs.last_seq(self._master, node_id)

    def fence(self, node_id: str, upto_seq: int | None = None, *, epoch: int | None = None) -> int:
        """Give up on every publish with seq <= ``upto_seq`` (default: the newest handed out): the
        master refuses them from now on, wherever they are (queued here, in a socket, in flight).
        Returns the node's fence. Entries already applied stay: unpublish them before freeing."""
        epoch = self._regs.epoch(self._master, node_id, epoch)
        upto = self.last_publish_seq(node_id) if upto_seq is None else upto_seq
        return self._ask(ops.encode_fence(node_id, epoch, upto), ops.decode_fence_reply)

    def unpublish_if_unlocked(self, node_id: str, keys: Sequence[bytes], *, epoch: int | None = None,
                              fence_seq: int | None = None) -> list[bytes]:
        """Keys this node no longer publishes (removed now or absent): their blocks may be reused.
        Keys pinned by a valid reader lock stay published and are left out.

        ``fence_seq``: first give up on every publish with seq <= it (see ``fence``), in the same
        step. A holder frees a block only after its key came back from a call whose fence covers
        every publish that carried the key; else a late publish could name a reused block."""
        epoch = self._regs.epoch(self._master, node_id, epoch)
        keys = list(keys)
        out: list[bytes] = []
        step = 16384
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            removed = self._ask(ops.encode_unpublish(node_id, batch, epoch, fence_seq), ops.decode_unpublish_reply, len(batch))
            out.extend(batch[i] for i in removed)
        return out

    def stats(self) -> dict:
        return self._ask(ops.encode_stats(), ops.decode_stats_reply)

    def ping(self) -> dict:
        return self._ask(ops.encode_ping(), ops.decode_ping_reply)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
        for c in pool:
            c.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
