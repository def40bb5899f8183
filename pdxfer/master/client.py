"""Synchronous pdxfer-master client (thread-safe, bounded waits) and a node lease keeper.

Each call takes a persistent TCP connection from a small pool (one per concurrent caller), sends
one frame and waits for its reply, so concurrent threads never wait on each other's round trips.
Every call finishes within ``timeout_s`` (plus at most one socket timeout granularity) or raises
``MasterUnavailable``.

Addresses: ``"host:port"`` of one master, or ``"etcd://host:port[,host:port]/prefix"``: the client
reads the current leader from etcd (through etcd's JSON gateway, stdlib only) and follows leader
changes: on a refused connection or a "not leader" answer it re-reads the leader and retries
within the same time budget.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pdxfer import netio
from pdxfer.master import protocol as P

log = logging.getLogger("pdxfer.master.client")


@dataclass
class NodeInfo:
    node_id: str
    rank: int
    transport: str
    transport_metadata: bytes
    layout: dict
    layout_fingerprint: str


@dataclass(slots=True)
class ChunkLocation:
    key: bytes
    node_id: str
    block_ids: list[int]


@dataclass
class LookupResult:
    lock_id: str | None
    hit_chunks: int
    locations: list[ChunkLocation]
    nodes: dict[str, NodeInfo]
    lock_ttl_s: float


class MasterError(RuntimeError):
    """Base of every error the client raises."""


class MasterUnavailable(MasterError):
    """No master answered within the time budget (refused, reset, timed out, no leader)."""


class MasterProtocolError(MasterError):
    """The master refused a message as malformed, oversized or of another version (or vice versa)."""


class MasterAuthError(MasterError):
    """The master refused the token."""


class UnknownNode(MasterError):
    """The master does not know this node (never registered, deregistered, or lease expired)."""


class _Closed(Exception):
    pass


class _StaleNodeCache(Exception):
    pass


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {text!r} is not host:port")
    return host.strip("[]"), int(port)


class _Conn:
    def __init__(self, addr: tuple[str, int], timeout: float) -> None:
        self.addr = addr
        self.sock = socket.create_connection(addr, timeout=max(timeout, 0.001))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ids = itertools.count(1)
        self.used = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv_exact(self, n: int) -> bytes:
        return netio.recv_exact(self.sock, n, "master reply", _Closed)

    def request(self, op: int, doc: dict[str, Any], blob: bytes, deadline: float) -> tuple[int, dict[str, Any], bytes]:
        req_id = next(self.ids) & 0xFFFFFFFF
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        self.sock.sendall(P.encode_frame(op, req_id, doc, blob))
        self.used = True
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        hdr = P.parse_header(self._recv_exact(P.HEADER_BYTES))
        body = self._recv_exact(hdr.json_len + hdr.blob_len) if hdr.json_len + hdr.blob_len else b""
        if hdr.req_id != req_id:
            raise P.ProtocolError(P.ERR_MALFORMED, f"reply to request {hdr.req_id}, expected {req_id}")
        return hdr.op, P.decode_json(body[: hdr.json_len]), body[hdr.json_len :]


def resolve_etcd_leader(endpoints: Sequence[tuple[str, int]], prefix: str, timeout_s: float) -> str | None:
    """The leader address published under ``prefix``/leader, or None if there is none right now."""
    key = base64.b64encode(f"{prefix.rstrip('/')}/leader".encode()).decode()
    last: Exception | None = None
    for host, port in endpoints:
        req = urllib.request.Request(
            f"http://{host}:{port}/v3/kv/range", data=json.dumps({"key": key}).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=max(timeout_s, 0.05)) as resp:
                doc = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = exc
            continue
        kvs = doc.get("kvs") or []
        if not kvs:
            return None
        try:
            addr = str(json.loads(base64.b64decode(kvs[0]["value"]))["addr"])
            parse_hostport(addr)
        except (ValueError, KeyError, TypeError) as exc:
            raise MasterUnavailable(f"leader record under {prefix} in etcd is malformed: {exc}") from None
        return addr
    raise MasterUnavailable(f"no etcd endpoint answered: {last}")


class MasterClient:
    def __init__(self, address: str, token: str | None = None, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.token = token
        self._lock = threading.Lock()
        self._pool: list[_Conn] = []
        self._closed = False
        # Node descriptions by (node id, epoch), and the epochs we tell the master we have.
        self._node_cache: dict[tuple[str, int], NodeInfo] = {}
        self._have: dict[str, int] = {}
        self._etcd: list[tuple[str, int]] | None = None
        self._etcd_prefix = ""
        self._addr: tuple[str, int] | None = None
        if address.startswith("etcd://"):
            rest = address[len("etcd://") :]
            hosts, _, prefix = rest.partition("/")
            self._etcd = [parse_hostport(h) for h in hosts.split(",") if h]
            if not self._etcd:
                raise ValueError(f"no etcd endpoint in {address!r}")
            self._etcd_prefix = "/" + prefix if prefix else "/pdxfer/master"
        else:
            self._addr = parse_hostport(address)

    # ---- plumbing -------------------------------------------------------------------------------

    def _leader(self, deadline: float) -> tuple[str, int]:
        with self._lock:
            addr = self._addr
        if addr is not None:
            return addr
        assert self._etcd is not None
        found = resolve_etcd_leader(self._etcd, self._etcd_prefix, deadline - time.monotonic())
        if found is None:
            raise MasterUnavailable(f"no leader published under {self._etcd_prefix} in etcd")
        addr = parse_hostport(found)
        with self._lock:
            self._addr = addr
        return addr

    def _forget_leader(self, addr: tuple[str, int]) -> None:
        if self._etcd is None:
            return
        with self._lock:
            if self._addr == addr:
                self._addr = None
            stale = [c for c in self._pool if c.addr == addr]
            self._pool = [c for c in self._pool if c.addr != addr]
        for c in stale:
            c.close()

    def _take(self, addr: tuple[str, int], deadline: float) -> _Conn:
        with self._lock:
            if self._closed:
                raise MasterError("client is closed")
            while self._pool:
                c = self._pool.pop()
                if c.addr == addr:
                    return c
                c.close()
        try:
            return _Conn(addr, deadline - time.monotonic())
        except OSError as exc:
            raise MasterUnavailable(f"cannot connect to master {addr[0]}:{addr[1]}: {exc}") from None

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._pool) < 64:
                self._pool.append(conn)
                return
        conn.close()

    def _call(self, op: int, doc: dict[str, Any], blob: bytes = b"") -> tuple[dict[str, Any], bytes]:
        if self.token is not None:
            doc["tok"] = self.token
        deadline = time.monotonic() + self.timeout_s
        last = "no attempt"
        for attempt in itertools.count():
            if attempt and time.monotonic() >= deadline:
                raise MasterUnavailable(f"{P.OP_NAMES.get(op, op)}: no master answered within {self.timeout_s}s ({last})")
            addr = None
            try:
                addr = self._leader(deadline)
                conn = self._take(addr, deadline)
            except MasterUnavailable as exc:
                last = str(exc)
                if self._etcd is None:
                    raise
                if addr is not None:
                    self._forget_leader(addr)  # refused: the leader we knew is gone; ask etcd again
                time.sleep(min(0.05 * (attempt + 1), max(deadline - time.monotonic(), 0)))
                continue
            reused = conn.used
            try:
                rop, rdoc, rblob = conn.request(op, doc, blob, deadline)
            except (OSError, _Closed) as exc:
                conn.close()
                last = f"{addr[0]}:{addr[1]}: {exc!r}"
                if reused and not isinstance(exc, socket.timeout):
                    continue  # a pooled connection the master had closed: retry on a fresh one
                self._forget_leader(addr)
                if self._etcd is None or isinstance(exc, socket.timeout):
                    raise MasterUnavailable(f"{P.OP_NAMES.get(op, op)}: {last}") from None
                time.sleep(min(0.05 * (attempt + 1), max(deadline - time.monotonic(), 0)))
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
                    if self._etcd is None:
                        raise MasterUnavailable(msg)
                    time.sleep(min(0.05 * (attempt + 1), max(deadline - time.monotonic(), 0)))
                    continue
                if code == P.ERR_UNKNOWN_NODE:
                    raise UnknownNode(msg)
                if code == P.ERR_INTERNAL:
                    raise MasterError(msg)
                raise MasterProtocolError(msg)
            self._give(conn)
            if rop != op | P.REPLY_BIT:
                raise MasterProtocolError(f"reply op {rop} does not answer op {op}")
            return rdoc, rblob
        raise AssertionError("unreachable")

    # ---- API ------------------------------------------------------------------------------------

    def register_node(self, info: NodeInfo, lease_ttl_s: float = 10.0) -> None:
        meta = bytes(info.transport_metadata)
        self._call(
            P.OP_REGISTER,
            {
                "node_id": info.node_id, "rank": int(info.rank), "transport": info.transport,
                "layout": info.layout, "fp": info.layout_fingerprint, "ttl": float(lease_ttl_s),
            },
            meta,
        )

    def heartbeat(self, node_id: str) -> bool:
        doc, _ = self._call(P.OP_HEARTBEAT, {"node_id": node_id})
        return bool(doc.get("ok"))

    def deregister_node(self, node_id: str) -> None:
        self._call(P.OP_DEREGISTER, {"node_id": node_id})

    def publish(
        self, node_id: str, entries: Sequence[tuple[bytes, Sequence[int]]], retention_s: float | None = None
    ) -> int:
        if not entries:
            return 0
        accepted = 0
        # Batches bounded well below the frame limits.
        step = 4096
        for start in range(0, len(entries), step):
            batch = entries[start : start + step]
            keys = P.join_keys([k for k, _ in batch])
            counts = [len(b) for _, b in batch]
            blocks = P.pack_u32([int(x) for _, b in batch for x in b])
            doc: dict[str, Any] = {"node_id": node_id, "n": len(batch)}
            if all(c == counts[0] for c in counts):
                doc["per"] = counts[0]
            else:
                doc["counts"] = counts
            if retention_s is not None:
                doc["ret"] = float(retention_s)
            rdoc, _ = self._call(P.OP_PUBLISH, doc, keys + blocks)
            accepted += int(rdoc["accepted"])
        return accepted

    def lookup_and_lock(self, keys: Sequence[bytes], reader: str, lock_ttl_s: float = 10.0) -> LookupResult:
        keys = list(keys)
        if not keys:
            return LookupResult(None, 0, [], {}, lock_ttl_s)
        joined = P.join_keys(keys)
        for attempt in range(2):
            with self._lock:
                have = dict(self._have) if attempt == 0 else {}
            doc, blob = self._call(
                P.OP_LOOKUP, {"n": len(keys), "reader": reader, "ttl": float(lock_ttl_s), "have": have}, joined
            )
            try:
                return self._parse_lookup(keys, doc, blob)
            except _StaleNodeCache:
                # Another thread evicted a node description between request and reply: drop
                # this lock and ask again with the full descriptions.
                if doc.get("lock"):
                    self.release(doc["lock"])
        raise MasterProtocolError("lookup reply referenced node descriptions the client does not have")

    def _node_from(self, nid: str, d: dict[str, Any]) -> NodeInfo:
        ck = (nid, int(d["epoch"]))
        if "meta" not in d:  # the master sent the epoch only: we told it we have this one
            info = self._node_cache.get(ck)
            if info is None:
                raise _StaleNodeCache(nid)
            return info
        info = NodeInfo(nid, int(d["rank"]), d["transport"], base64.b64decode(d["meta"]), d["layout"], d["fp"])
        with self._lock:
            if len(self._node_cache) >= 1024:  # bounded: forget the older half
                for old in list(self._node_cache)[:512]:
                    del self._node_cache[old]
                    if self._have.get(old[0]) == old[1]:
                        del self._have[old[0]]
            self._node_cache[ck] = info
            if len(self._have) < 256 or nid in self._have:
                self._have[nid] = ck[1]
        return info

    def _parse_lookup(self, keys: list[bytes], doc: dict[str, Any], blob: bytes) -> LookupResult:
        hit = int(doc["hit"])
        if hit == 0:
            return LookupResult(None, 0, [], {}, float(doc.get("ttl", 0.0)))
        blocks = P.unpack_u32(blob)
        counts = doc["counts"] if "counts" in doc else None
        nodes = {nid: self._node_from(nid, d) for nid, d in doc["nodes"].items()}
        node_ids: list[str] = []
        for nid, run in doc["runs"]:
            node_ids += [nid] * run
        if "per" in doc:
            per = int(doc["per"])
            total = per * hit
            block_lists = [blocks[o : o + per] for o in range(0, total, per)] if per else [[] for _ in range(hit)]
        else:
            offs = list(itertools.accumulate(counts, initial=0))
            total = offs[-1]
            block_lists = [blocks[offs[j] : offs[j + 1]] for j in range(hit)]
        if len(node_ids) != hit or total != len(blocks) or (counts is not None and len(counts) != hit):
            raise MasterProtocolError(f"lookup reply inconsistent: {len(node_ids)} holders, {len(blocks)} block ids, hit {hit}")
        locations = list(map(ChunkLocation, keys[:hit], node_ids, block_lists))
        return LookupResult(doc["lock"], hit, locations, nodes, float(doc["ttl"]))

    def release(self, lock_id: str) -> bool:
        doc, _ = self._call(P.OP_RELEASE, {"lock": lock_id})
        return bool(doc["ok"])

    def unpublish_if_unlocked(self, node_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Keys this node no longer publishes (removed now or absent): their blocks may be reused.
        Keys pinned by a valid reader lock stay published and are left out."""
        keys = list(keys)
        if not keys:
            return []
        out: list[bytes] = []
        step = 16384
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            doc, _ = self._call(P.OP_UNPUBLISH, {"node_id": node_id, "n": len(batch)}, P.join_keys(batch))
            out.extend(batch[i] for i in doc["removed"])
        return out

    def stats(self) -> dict:
        doc, _ = self._call(P.OP_STATS, {})
        return doc

    def ping(self) -> dict:
        doc, _ = self._call(P.OP_PING, {})
        return doc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
        for c in pool:
            c.close()

    def __enter__(self) -> "MasterClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NodeSession:
    """Keeps one node registered from a background thread.

    Heartbeats when a third of the lease has been used (i.e. on the *remaining* lease time, measured
    from when the last successful heartbeat was sent), retries quickly while the master is
    unreachable, and when the master says it forgot the node (failover, restart, lease lost)
    re-registers and calls ``on_reregistered()`` so the owner re-publishes what it holds.
    """

    def __init__(
        self,
        client: MasterClient,
        info: NodeInfo,
        lease_ttl_s: float = 10.0,
        on_reregistered: Callable[[], None] | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        self.client = client
        self.info = info
        self.lease_ttl_s = lease_ttl_s
        self.on_reregistered = on_reregistered
        self.registered = False
        self.reregistrations = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self.client.register_node(self.info, self.lease_ttl_s)
            self.registered = True
            self._sent_at = time.monotonic()
        except MasterError as exc:
            log.warning("node %s: first registration failed (%s); retrying in the background", self.info.node_id, exc)
        self._thread = threading.Thread(target=self._run, name=f"pdxfer-node-{self.info.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ttl = self.lease_ttl_s
        next_at = time.monotonic() + ttl / 3 if self.registered else time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            sent = time.monotonic()
            try:
                if self.registered:
                    if self.client.heartbeat(self.info.node_id):
                        next_at = sent + ttl / 3
                        continue
                    log.warning("node %s: master forgot this node; re-registering", self.info.node_id)
                    self.registered = False
                self.client.register_node(self.info, ttl)
                self.registered = True
                self.reregistrations += 1
                next_at = sent + ttl / 3
                if self.on_reregistered is not None:
                    try:
                        self.on_reregistered()
                    except Exception:  # the owner's bug must not stop the lease keeper
                        log.exception("node %s: on_reregistered failed", self.info.node_id)
            except MasterError as exc:
                log.debug("node %s: master unreachable: %s", self.info.node_id, exc)
                next_at = time.monotonic() + min(0.2, ttl / 10) * (0.5 + random.random())

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s * 3 + 1)
        if deregister and self.registered:
            try:
                self.client.deregister_node(self.info.node_id)
            except MasterError as exc:
                log.warning("node %s: deregister failed: %s", self.info.node_id, exc)
        self.registered = False


@dataclass
class LocalMaster:
    """A pdxfer-master child process started by :func:`start_local_master`."""

    proc: subprocess.Popen
    host: str
    port: int
    http_port: int
    workdir: str
    log_path: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    def stop(self, timeout_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_local_master(
    host: str = "127.0.0.1",
    token: str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 15.0,
    workdir: str | None = None,
    env: dict[str, str] | None = None,
) -> LocalMaster:
    """Start ``pdxfer-master`` as a child process on OS-chosen ports; returns once it listens."""
    workdir = workdir or tempfile.mkdtemp(prefix="pdxfer-master-")
    port_file = os.path.join(workdir, f"port-{os.getpid()}-{random.getrandbits(32):08x}")
    log_path = port_file + ".log"
    cmd = [sys.executable, "-m", "pdxfer.master.service", "--host", host, "--port", "0", "--port-file", port_file]
    if token is not None:
        tok_path = port_file + ".token"
        fd = os.open(tok_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        cmd += ["--token-file", tok_path]
    cmd += list(extra_args)
    logf = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    logf.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"pdxfer-master exited with {proc.returncode}:\n{tail}")
        try:
            with open(port_file) as f:
                parts = f.read().split()
            return LocalMaster(proc, host, int(parts[0]), int(parts[1]), workdir, log_path)
        except (FileNotFoundError, IndexError, ValueError):
            time.sleep(0.02)
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"pdxfer-master did not start listening within {timeout_s}s (log: {log_path})")
