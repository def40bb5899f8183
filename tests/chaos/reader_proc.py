"""A chaos reader: lookup_and_lock through the real client, read the blocks with the real
transport, decode what arrived, release, and log all of it (the checker decides afterwards).

  python -m tests.chaos.reader_proc --config CFG --reader R --log FILE --master ADDR

Sometimes it picks a lock TTL shorter than its read or sleeps past the TTL before releasing
(the ``lock_expire`` fault); a read is "validated" only when ``release()`` returned True.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

import numpy as np

from pdxfer.master import MasterClient, MasterError
from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion, TransportError
from tests.chaos.common import (
    ChaosConfig,
    OpLog,
    Timed,
    ctl,
    decode_block,
    die_with_parent,
    key_bytes,
    key_name,
    open_fds,
    settle_threads,
)


class Reader:
    def __init__(self, cfg: ChaosConfig, idx: int, log: OpLog, master: str) -> None:
        self.cfg, self.idx, self.log = cfg, idx, log
        self.name = f"r{idx}"
        self.rng = random.Random(cfg.seed * 7777 + idx)
        self.buf = np.zeros((cfg.chunks, cfg.block_bytes), dtype=np.uint8)
        self.transport = create_transport(cfg.transport, **({"io_timeout": cfg.io_timeout_s}
                                                            if cfg.transport == "tcp" else {}))
        self.transport.register([RegisteredRegion(0, self.buf.ctypes.data, self.buf.nbytes)])
        self.client = MasterClient(master, timeout_s=cfg.master_timeout_s)
        self.peers: dict[str, tuple[bytes, str]] = {}  # node id -> (metadata, peer id)

    def _peer(self, node_id: str, meta: bytes, timeout: float) -> str:
        cached = self.peers.get(node_id)
        if cached is not None and cached[0] == meta:
            return cached[1]
        if cached is not None:  # the node restarted: drop the old connection (no leak)
            self.peers.pop(node_id)
            try:
                self.transport.disconnect(cached[1])
            except TransportError:
                pass
        peer = self.transport.connect(meta, timeout=timeout)
        self.peers[node_id] = (meta, peer)
        return peer

    def once(self) -> None:
        cfg = self.cfg
        p = self.rng.randrange(cfg.prompts)
        names = [key_name(p, i) for i in range(cfg.chunks)]
        ttl, sleep_past, sleep_before = cfg.lock_ttl_s, 0.0, 0.0
        kind = "normal"
        roll = self.rng.random()
        if roll < cfg.short_ttl_p:
            ttl, kind = self.rng.uniform(0.01, 0.2), "short_ttl"
        elif roll < cfg.short_ttl_p + cfg.sleep_past_ttl_p:
            ttl, kind = self.rng.uniform(0.1, 0.4), "sleep_past_ttl"
            sleep_past = ttl + 0.1
        elif roll < cfg.short_ttl_p + cfg.sleep_past_ttl_p + cfg.long_ttl_p:
            # A slow reader with a long lock: the master accepts any TTL, a holder that assumes
            # its own lock TTL may give the blocks away under it (issue 9 hole 6).
            ttl, kind, sleep_before = cfg.long_ttl_s, "long_ttl", cfg.long_ttl_sleep_s
        t = Timed()
        try:
            r = self.client.lookup_and_lock([key_bytes(k) for k in names], reader=self.name, lock_ttl_s=ttl)
        except MasterError as exc:
            self.log.write("lookup", keys=len(names), ok=False, err=repr(exc)[:200], **t.fields())
            return
        locs = [(names[i], loc.node_id, list(loc.block_ids)) for i, loc in enumerate(r.locations)]
        self.log.write("lookup", keys=len(names), ok=True, hit=r.hit_chunks, lock=r.lock_id, ttl=ttl,
                       **t.fields())
        if not r.lock_id:
            return
        rec: dict[str, Any] = {"lock": r.lock_id, "ttl": ttl, "kind": kind, "locations": locs,
                               "lookup_t0": t.w0}
        self.buf[: len(locs)] = 0  # nothing left over from an earlier read can pass as this one
        if sleep_before:  # a slow reader: it reads at once when the run stops (the quiet period waits for it)
            until = time.monotonic() + sleep_before
            while time.monotonic() < until and not ctl(cfg.workdir, "stop"):
                time.sleep(min(0.05, max(until - time.monotonic(), 0.0)))
        t = Timed()
        err = None
        handles = []
        # One deadline for connects and reads together: the whole read is bounded by read_timeout_s.
        deadline = time.monotonic() + cfg.read_timeout_s
        try:
            by_node: dict[str, list[TransferRun]] = {}
            for slot, (_, node, blocks) in enumerate(locs):
                b = blocks[0]
                by_node.setdefault(node, []).append(
                    TransferRun(0, b * cfg.block_bytes, 0, slot * cfg.block_bytes, cfg.block_bytes))
            for node, runs in by_node.items():
                peer = self._peer(node, r.nodes[node].transport_metadata, max(deadline - time.monotonic(), 0.001))
                handles.append(self.transport.read(peer, TransferPlan(tuple(runs), len(runs))))
            for h in handles:
                h.wait(max(deadline - time.monotonic(), 0.001))
        except (TransportError, KeyError, OSError) as exc:
            err = f"{type(exc).__name__}: {exc}"[:200]
            for h in handles:
                try:
                    h.cancel()
                except TransportError:
                    pass
        rec["read"] = {"err": err, **t.fields()}
        rec["seen"] = [decode_block(self.buf[i].tobytes()) for i in range(len(locs))]
        if sleep_past:
            time.sleep(sleep_past)
        t = Timed()
        try:
            valid: bool | None = bool(self.client.release(r.lock_id))
            rerr = None
        except MasterError as exc:
            valid, rerr = None, repr(exc)[:200]
        rec["release"] = {"valid": valid, "err": rerr, **t.fields()}
        self.log.write("read", **rec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos-reader")
    ap.add_argument("--config", required=True)
    ap.add_argument("--reader", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--master", required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    with open(args.config) as f:
        cfg = ChaosConfig.from_json(f.read())
    log = OpLog(args.log, f"reader{args.reader}")
    fds0, threads0 = open_fds(), threading.active_count()
    if cfg.reader_is_kv(args.reader):
        # The connector halves run without vLLM (its base classes fall back); importing it would
        # cost this process ~20 s of a loaded machine's time for nothing.
        sys.modules.setdefault("vllm", None)  # type: ignore[arg-type]
        from tests.chaos.kv_reader import KVReader

        kr = KVReader(cfg, args.reader, log, args.master)
        log.write("start", fds=fds0, threads=threads0, kv_format=kr.side.kv_format, block_size=kr.side.block_size)
        while not ctl(cfg.workdir, "stop"):
            kr.once()
            time.sleep(kr.rng.uniform(*cfg.op_gap_s))
        unreadable = kr.unreadable()
        kr.close()
        fds1, threads1 = open_fds(), settle_threads(threads0)
        log.write("final", fds_start=fds0, fds_end=fds1, threads_start=threads0, threads_end=threads1,
                  unreadable=unreadable)
        log.close()
        return 0
    rd = Reader(cfg, args.reader, log, args.master)
    log.write("start", fds=fds0, threads=threads0)
    while not ctl(cfg.workdir, "stop"):
        rd.once()
        time.sleep(rd.rng.uniform(*cfg.op_gap_s))
    rd.client.close()
    rd.transport.close()
    fds1, threads1 = open_fds(), settle_threads(threads0)
    log.write("final", fds_start=fds0, fds_end=fds1, threads_start=threads0, threads_end=threads1,
              peers=len(rd.peers))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
