"""The pdxfer-master service: the wire protocol server around the in-memory chunk index.

One asyncio event loop owns the index, so every request is applied atomically in arrival order.
See ``pdxfer/master/__init__.py`` for the CLI flags.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import gc
import hmac
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from pdxfer.master import protocol as P
from pdxfer.master.coordinator import Standalone
from pdxfer.master.httpd import serve_http
from pdxfer.master.index import ChunkIndex, UnknownNodeError

log = logging.getLogger("pdxfer.master")

_BODY_TIMEOUT_S = 10.0  # a client that sent a header must send the body within this
_MAX_TTL_S = 3600.0
_MAX_RETENTION_S = 30 * 24 * 3600.0


class MasterService:
    def __init__(
        self,
        token: str | None = None,
        coordinator: Any = None,
        chunk_tokens: int = 256,
        max_entries: int = 10_000_000,
        reap_interval_s: float = 0.1,
    ) -> None:
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
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._conns: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.http_port = 0

    # ---- leadership -----------------------------------------------------------------------------

    def _became_leader(self) -> None:
        log.info("serving as leader (%s store)", self.coord.kind)

    def _lost_leader(self) -> None:
        # Whatever we knew may already be wrong under the new leader: forget it, and drop clients
        # so they reconnect to whoever leads now.
        log.warning("lost leadership: clearing the index and closing client connections")
        self.index.clear()
        for w in list(self._conns):
            w.close()

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, host: str, port: int, http_host: str | None, http_port: int, advertise: str | None) -> None:
        # A small reader limit would pause/resume the socket many times per 16 KiB lookup body.
        server = await asyncio.start_server(self._serve_conn, host, port, limit=1 << 20)
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        if http_port >= 0:
            hs = await serve_http(http_host or host, http_port, self.metrics_text, self.health)
            self._servers.append(hs)
            self.http_port = hs.sockets[0].getsockname()[1]
        self._tasks.append(asyncio.create_task(self._reaper()))
        await self.coord.start(advertise or f"{host}:{self.port}")

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self._servers:
            s.close()
        for w in list(self._conns):
            w.close()
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
            if not self._rate or now - self._rate[-1][0] >= 1.0:
                self._rate.append((now, self.index.counters.lookups))

    # ---- connections ----------------------------------------------------------------------------

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._conns.add(writer)
        try:
            while True:
                try:
                    raw = await reader.readexactly(P.HEADER_BYTES)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                req_id = int.from_bytes(raw[4:8], "big") if len(raw) >= 8 else 0
                try:
                    hdr = P.parse_header(raw)
                except P.ProtocolError as exc:
                    # Framing cannot be trusted after a bad header: answer, then hang up.
                    self.bad_frames += 1
                    log.warning("bad frame from %s: %s", peer, exc)
                    writer.write(P.encode_frame(P.OP_ERROR, req_id, {"err": exc.code, "msg": str(exc)}))
                    await writer.drain()
                    return
                try:
                    body = await asyncio.wait_for(reader.readexactly(hdr.json_len + hdr.blob_len), _BODY_TIMEOUT_S)
                except asyncio.TimeoutError:
                    self.bad_frames += 1
                    log.warning("client %s sent a header but not its %d-byte body within %.0f s", peer,
                                hdr.json_len + hdr.blob_len, _BODY_TIMEOUT_S)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.bad_frames += 1
                    log.warning("client %s closed mid-frame (truncated message)", peer)
                    return
                reply, keep = self._handle(hdr, body, peer)
                writer.write(reply)
                await writer.drain()
                if not keep:
                    return
        except ConnectionError:
            return
        finally:
            self._conns.discard(writer)
            writer.close()

    def _handle(self, hdr: P.Header, body: bytes, peer: Any) -> tuple[bytes, bool]:
        """One request -> (reply frame, keep the connection open)."""
        try:
            doc = P.decode_json(body[: hdr.json_len])
            if self.token is not None:
                tok = doc.get("tok")
                if not isinstance(tok, str) or not hmac.compare_digest(tok.encode(), self.token):
                    self.auth_failures += 1
                    log.warning("refused %s request from %s: %s token", P.OP_NAMES.get(hdr.op, hdr.op), peer,
                                "missing" if tok is None else "wrong")
                    raise P.ProtocolError(P.ERR_AUTH, "missing or wrong token")
            if hdr.op not in (P.OP_STATS, P.OP_PING) and not self.coord.is_leader:
                leader = self.coord.leader_address
                raise P.ProtocolError(P.ERR_NOT_LEADER, f"this master is a standby; leader is {leader}")
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
        except Exception as exc:  # a bug must not take the service down for everyone else
            log.exception("internal error on %s from %s", P.OP_NAMES.get(hdr.op, hdr.op), peer)
            return P.encode_frame(P.OP_ERROR, hdr.req_id, {"err": P.ERR_INTERNAL, "msg": repr(exc)}), False

    def _dispatch(self, op: int, doc: dict[str, Any], blob: memoryview) -> Any:
        now = time.monotonic()
        idx = self.index
        if op == P.OP_LOOKUP:
            t0 = time.perf_counter()
            n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
            self._exact_blob(blob, n * 32)
            keys = P.split_keys(blob, n)
            reader = P.get_str(doc, "reader")
            ttl = P.get_float(doc, "ttl", 0.001, _MAX_TTL_S)
            out = idx.lookup_and_lock(keys, reader, ttl, now)
            head: dict[str, Any] = {"lock": out.lock_id, "hit": out.hit, "ttl": ttl, "runs": out.runs}
            counts = out.counts
            if counts and counts.count(counts[0]) == len(counts):  # C-speed uniformity check
                head["per"] = counts[0]
            else:
                head["counts"] = out.counts
            # Node descriptions are pre-encoded at registration; splice them in, never re-encode.
            # A node the client already holds at this epoch ("have") is sent as its epoch only:
            # a real layout description is ~12 KB of JSON, costlier to parse than the lookup.
            have = doc.get("have")
            if not isinstance(have, dict):
                have = {}
            nodes = ",".join(
                f'{json.dumps(nid)}:{{"epoch":{node.epoch}}}' if have.get(nid) == node.epoch
                else f"{json.dumps(nid)}:{node.info_json}"
                for nid, node in out.nodes.items()
            )
            text = json.dumps(head, separators=(",", ":"))[:-1] + ',"nodes":{' + nodes + "}}"
            self.lookup_seconds += time.perf_counter() - t0
            return (text.encode(), out.blocks)
        if op == P.OP_RELEASE:
            return {"ok": idx.release(P.get_str(doc, "lock"), now)}
        if op == P.OP_PUBLISH:
            node_id = P.get_str(doc, "node_id")
            n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
            counts = self._counts(doc, n)
            total = sum(counts)
            self._exact_blob(blob, n * 32 + 4 * total)
            keys = P.split_keys(blob, n)
            blocks = bytes(blob[n * 32 :])
            items = []
            off = 0
            for key, c in zip(keys, counts):
                items.append((key, blocks[off : off + 4 * c]))
                off += 4 * c
            retention = P.get_float(doc, "ret", 0.0, _MAX_RETENTION_S, optional=True)
            return {"accepted": idx.publish(node_id, items, retention, now)}
        if op == P.OP_UNPUBLISH:
            node_id = P.get_str(doc, "node_id")
            n = P.get_int(doc, "n", 0, P.MAX_KEYS_PER_REQUEST)
            self._exact_blob(blob, n * 32)
            return {"removed": idx.unpublish_if_unlocked(node_id, P.split_keys(blob, n), now)}
        if op == P.OP_HEARTBEAT:
            node_id = P.get_str(doc, "node_id")
            left = idx.heartbeat(node_id, now)
            if left is not None:
                self.coord.node_heartbeat(node_id)
            return {"ok": left is not None, "ttl": left}
        if op == P.OP_REGISTER:
            return self._register(doc, blob, now)
        if op == P.OP_DEREGISTER:
            return {"ok": idx.deregister(P.get_str(doc, "node_id"))}
        if op == P.OP_STATS:
            return self.stats()
        if op == P.OP_PING:
            return {"leader": self.coord.is_leader, "leader_address": self.coord.leader_address}
        raise P.ProtocolError(P.ERR_UNKNOWN_OP, f"unknown op {op}")

    @staticmethod
    def _exact_blob(blob: memoryview, expected: int) -> None:
        if len(blob) != expected:
            raise P.ProtocolError(P.ERR_MALFORMED, f"blob is {len(blob)} bytes, the fields announce {expected}")

    @staticmethod
    def _counts(doc: dict[str, Any], n: int) -> list[int]:
        if "per" in doc:
            return [P.get_int(doc, "per", 0, P.MAX_BLOCKS_PER_CHUNK)] * n
        counts = doc.get("counts")
        if (
            not isinstance(counts, list)
            or len(counts) != n
            or not all(type(c) is int and 0 <= c <= P.MAX_BLOCKS_PER_CHUNK for c in counts)
        ):
            raise P.ProtocolError(
                P.ERR_MALFORMED, f"field 'counts' must be {n} integers in [0, {P.MAX_BLOCKS_PER_CHUNK}]"
            )
        return counts

    def _register(self, doc: dict[str, Any], blob: memoryview, now: float) -> dict[str, Any]:
        node_id = P.get_str(doc, "node_id")
        rank = P.get_int(doc, "rank", 0, 1 << 20)
        transport = P.get_str(doc, "transport")
        fp = P.get_str(doc, "fp")
        layout = doc.get("layout")
        if not isinstance(layout, dict):
            raise P.ProtocolError(P.ERR_MALFORMED, "field 'layout' must be an object")
        ttl = P.get_float(doc, "ttl", 0.1, _MAX_TTL_S)
        if len(blob) > P.MAX_METADATA_BYTES:
            raise P.ProtocolError(P.ERR_OVERSIZED, f"transport metadata of {len(blob)} bytes exceeds {P.MAX_METADATA_BYTES}")
        info = {
            "node_id": node_id,
            "rank": rank,
            "transport": transport,
            "meta": base64.b64encode(bytes(blob)).decode(),
            "layout": layout,
            "fp": fp,
        }
        epoch = self.index.register(node_id, "", ttl, now)
        info["epoch"] = epoch
        info_json = json.dumps(info, separators=(",", ":"))
        self.index.nodes[node_id].info_json = info_json
        self.coord.node_registered(node_id, ttl, info_json)
        log.info("registered node %s (rank %d, %s, ttl %.1fs)", node_id, rank, transport, ttl)
        return {"ok": True, "epoch": epoch, "ttl": ttl}

    # ---- observability --------------------------------------------------------------------------

    def lookups_per_s(self) -> float:
        if len(self._rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rate[max(0, len(self._rate) - 6)], self._rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def stats(self) -> dict[str, Any]:
        s = self.index.snapshot()
        s["hit_tokens"] = s["hit_chunks"] * self.chunk_tokens
        s["lookups_per_s"] = round(self.lookups_per_s(), 2)
        s["lookup_handler_s"] = round(self.lookup_seconds, 6)
        s["auth_failures"] = self.auth_failures
        s["bad_frames"] = self.bad_frames
        s["uptime_s"] = round(time.time() - self.started, 3)
        s.update(self.coord.status())
        return s

    def health(self) -> tuple[bool, dict[str, Any]]:
        st = self.coord.status()
        if not self.coord.is_leader:
            status = "standby"
        elif self.coord.degraded:
            status = "degraded"
        else:
            status = "ok"
        return True, {"status": status, **st}

    def metrics_text(self) -> str:
        s = self.stats()
        lines = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.append(f"# HELP pdxfer_master_{name} {help_}")
            lines.append(f"# TYPE pdxfer_master_{name} {kind}")
            lines.append(f"pdxfer_master_{name} {value}")

        metric("nodes", "gauge", "Registered nodes with a live lease.", s["nodes"])
        metric("entries", "gauge", "Published (key, node) entries.", s["entries"])
        metric("locks", "gauge", "Reader locks not yet released or reaped.", s["locks"])
        metric("lookups_total", "counter", "lookup_and_lock requests served.", s["lookups"])
        metric("lookup_chunks_total", "counter", "Chunks asked for in lookups.", s["lookup_chunks"])
        metric("hit_chunks_total", "counter", "Chunks found (contiguous prefix) in lookups.", s["hit_chunks"])
        metric("hit_tokens_total", "counter", "hit_chunks_total times chunk tokens.", s["hit_tokens"])
        metric("lookups_per_second", "gauge", "Recent lookup rate.", s["lookups_per_s"])
        metric("lookup_handler_seconds_total", "counter", "Time spent in the lookup handler.", self.lookup_seconds)
        metric("releases_ok_total", "counter", "Releases of locks still valid.", s["releases_ok"])
        metric("releases_expired_total", "counter", "Releases of expired or unknown locks.", s["releases_expired"])
        metric("unpublish_refused_total", "counter", "Unpublishes refused by a valid lock.", s["unpublish_refused"])
        metric("nodes_expired_total", "counter", "Nodes dropped because their lease ran out.", s["nodes_expired"])
        metric("auth_failures_total", "counter", "Requests refused for a missing or wrong token.", s["auth_failures"])
        metric("bad_frames_total", "counter", "Malformed, oversized or wrong-version messages.", s["bad_frames"])
        metric("leader", "gauge", "1 when this replica serves as leader.", 1 if self.coord.is_leader else 0)
        metric("degraded", "gauge", "1 when the store (etcd) is unreachable.", 1 if self.coord.degraded else 0)
        return "\n".join(lines) + "\n"


def _write_port_file(path: str, port: int, http_port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n{http_port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdxfer-master", description="pdxfer chunk index service")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on for the wire protocol")
    p.add_argument("--port", type=int, default=0, help="wire protocol port (0: chosen by the OS)")
    p.add_argument("--port-file", help="write '<port>\\n<http port>\\n' here once listening")
    p.add_argument("--http-host", help="address for /metrics and /health (default: --host)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (0: chosen by the OS, -1: off)")
    p.add_argument("--advertise", help="host:port published as leader address in etcd (default host:port)")
    p.add_argument("--token-file", help="shared secret every request must carry")
    p.add_argument("--etcd", help="host:port[,host:port] of etcd: HA mode (default: standalone, in memory)")
    p.add_argument("--etcd-prefix", default="/pdxfer/master", help="key prefix in etcd")
    p.add_argument("--leader-ttl", type=float, default=5.0, help="leader lease TTL in seconds (etcd mode)")
    p.add_argument("--etcd-timeout", type=float, default=1.0, help="per-call etcd timeout in seconds")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (for hit_tokens only)")
    p.add_argument("--max-entries", type=int, default=10_000_000, help="refuse publishes beyond this")
    p.add_argument("--log-level", default="INFO")
    return p


def _read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"pdxfer-master: cannot read token file {path}: {exc}") from None
    if not token:
        raise SystemExit(f"pdxfer-master: token file {path} is empty")
    return token


async def _amain(args: argparse.Namespace) -> None:
    coordinator = None
    if args.etcd and not args.advertise and args.host in ("0.0.0.0", "::", ""):
        raise SystemExit("pdxfer-master: listening on a wildcard address; give --advertise HOST:PORT so "
                         "clients that find the leader in etcd can reach it")
    if args.etcd:
        try:
            from pdxfer.master.etcd_store import EtcdCoordinator

            coordinator = EtcdCoordinator(args.etcd, args.etcd_prefix, args.leader_ttl, args.etcd_timeout)
        except ImportError as exc:
            raise SystemExit(f"pdxfer-master: --etcd needs the aetcd package ({exc})") from None
        except ValueError as exc:
            raise SystemExit(f"pdxfer-master: --etcd {args.etcd!r}: {exc}") from None
    svc = MasterService(
        token=_read_token(args.token_file) if args.token_file else None,
        coordinator=coordinator,
        chunk_tokens=args.chunk_tokens,
        max_entries=args.max_entries,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await svc.start(args.host, args.port, args.http_host, args.http_port, args.advertise)
    if args.port_file:
        _write_port_file(args.port_file, svc.port, svc.http_port)
    log.info("pdxfer-master listening on %s:%d (http %d, store %s)", args.host, svc.port, svc.http_port,
             svc.coord.kind)
    await stop.wait()
    log.info("shutting down")
    await svc.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
