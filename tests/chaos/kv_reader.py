"""The heterogeneous chaos reader (``ChaosConfig.kv``): a KV cache in its own format and block size
(:func:`tests.chaos.kv.reader_side`), loaded through pdxfer's real connector halves as vLLM drives
them, then checked token by token.

One request: ``ReaderPath.get_num_new_matched_tokens`` (lookup and lock, holders it can read),
blocks from its pool (shuffled, filled with the filler), ``update_state_after_alloc`` (the load
plan), ``WorkerSide.start_loads`` / ``get_finished`` (connect, READ direct or into staging,
convert, release), ``take_load_errors``. A load that finished without load errors is what vLLM
would compute on: every position it covers must hold exactly the pattern of this prompt's prefix
(:func:`tests.chaos.kv.check_tokens`); the record names where wrong positions came from.

``broken_grouping`` replaces the plan of loads that mix block sizes by a deliberately broken one
(issue 16 hole 1): a holder's consecutive chunk locations are grouped as if their blocks continued
each other. The checker must then find wrong KV.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any, Sequence

from pdxfer.kv.keys import IncrementalHasher
from pdxfer.master import MasterClient
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.vllm.metadata import HolderRef, LoadSpec, NodeRead, PdxferConnectorMetadata
from pdxfer.vllm.scheduler.reader import ReaderPath
from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats
from pdxfer.vllm.worker.worker_side import WorkerSide
from tests.chaos import kv
from tests.chaos.common import ChaosConfig, OpLog, Timed


class _FailReasons(logging.Handler):
    """Why a load failed, from the worker's own warning (``load of N tokens for REQ failed (WHY)``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) == 3 and "failed (" in str(record.msg):
            self.reasons[str(args[1])] = str(args[2])[:200]


def load_bound(cfg: ChaosConfig) -> float:
    """What one load may take: first contact, the read, the validating release (the checker adds slack)."""
    return min(1.0, cfg.read_timeout_s) + cfg.read_timeout_s + cfg.master_timeout_s


def broken_reads(lk: Any, block_ids: Sequence[int], chunk_tokens: int, block_size: int) -> tuple[NodeRead, ...]:
    """The deliberately wrong grouping: one read per run of consecutive chunks on one holder, the
    run's block ids concatenated (dropping only a repeat of the last one) as if each location went
    on where the previous one ended. Wrong as soon as a holder block is larger than a chunk and two
    chunks of one holder block sit in different blocks."""
    C, bs = chunk_tokens, block_size
    runs: list[dict[str, Any]] = []
    for i, loc in enumerate(lk.locations):
        hb = int(lk.nodes[loc.node_id].layout["block_size"])
        tok0 = (lk.first_chunk + i) * C
        ids = [int(b) for b in loc.block_ids]
        last = runs[-1] if runs else None
        if last is not None and last["node"] == loc.node_id and last["end"] == tok0:
            last["end"] = tok0 + C
            last["ids"] += [b for j, b in enumerate(ids) if not (j == 0 and b == last["ids"][-1])]
        else:
            runs.append({"node": loc.node_id, "hb": hb, "first": tok0 // hb * hb, "end": tok0 + C, "ids": ids})
    reads = []
    for r in runs:
        s, e, hb = max(0, r["first"]), min(lk.hit_end, r["end"]), r["hb"]
        if e <= s:
            continue
        skip = (s - r["first"]) // hb
        remote = tuple(r["ids"][skip: -(-(e - r["first"]) // hb)])
        local = tuple(int(b) for b in block_ids[s // bs: -(-e // bs)])
        if hb == bs:
            reads.append(NodeRead(r["node"], remote, local))
        else:
            reads.append(NodeRead(r["node"], remote, local, hb, r["first"] + skip * hb, s // bs * bs, s, e - s))
    return tuple(reads)


def split_blocks(lk: Any, chunk_tokens: int) -> int:
    """Consecutive chunks of one holder inside one holder block but in two different blocks: the
    shape a grouping that assumes continuing blocks gets wrong (counted to show the scenario met it)."""
    n = 0
    for i in range(len(lk.locations) - 1):
        a, b = lk.locations[i], lk.locations[i + 1]
        if a.node_id != b.node_id:
            continue
        hb = int(lk.nodes[a.node_id].layout["block_size"])
        t0, t1 = (lk.first_chunk + i) * chunk_tokens, (lk.first_chunk + i + 1) * chunk_tokens
        if hb > chunk_tokens and t0 // hb == t1 // hb and list(a.block_ids)[-1:] != list(b.block_ids)[:1]:
            n += 1
    return n


def _break_repull() -> None:
    """The deliberately wrong re-pull: it starts one block after the first position a failed
    read may have written, so that block keeps the failed holder's bytes next to the new ones."""
    from pdxfer.vllm.worker import repull

    right = repull.restart_token

    def wrong(rp: Any, reads: Any, incomplete: Any, block_size: int) -> int:
        return min(right(rp, reads, incomplete, block_size) + block_size, rp.end)

    repull.restart_token = wrong  # type: ignore[assignment]


class KVReader:
    def __init__(self, cfg: ChaosConfig, idx: int, log: OpLog, master: str) -> None:
        self.cfg = cfg
        self.idx, self.log, self.name = idx, log, f"r{idx}"
        self.rng = random.Random(cfg.seed * 7777 + idx)
        self.side = kv.reader_side(idx)
        C, bs = cfg.chunk_tokens, self.side.block_size
        self.prompts = {p: kv.prompt_tokens(cfg.seed, p, cfg.chunks, C) for p in range(cfg.prompts)}
        self.req_blocks = -(-(cfg.chunks * C + 1) // bs)
        self.num_blocks = 2 * self.req_blocks + 3
        self.phys, caches, layout = kv.new_cache(self.side, self.num_blocks)
        self.ccfg = ConnectorConfig(master=master, transport=cfg.transport, chunk_tokens=C,
                                    lookup_timeout_s=cfg.master_timeout_s, master_timeout_s=cfg.master_timeout_s,
                                    lock_ttl_s=cfg.lock_ttl_s, load_timeout_s=cfg.read_timeout_s,
                                    connect_timeout_s=min(1.0, cfg.read_timeout_s), staging_mib=cfg.staging_mib,
                                    publish_hint_wait_s=0.0)
        self.worker = WorkerSide(self.ccfg, node_id=f"chaos-reader{idx}", rank=0,
                                 expected_fingerprint=layout.fingerprint(), block_size=bs,
                                 kv_format=self.side.kv_format, tp_size=1, total_kv_heads=kv.HEADS)
        self.worker.register_kv_caches(caches)
        self.worker.round_log = []  # every round of reads (first read, re-pulls) for the checker
        if cfg.broken_repull:
            _break_repull()
        self.hot = MasterClient(master, timeout_s=cfg.master_timeout_s)
        self.bg = MasterClient(master, timeout_s=cfg.master_timeout_s)
        self.stats = SchedulerStats()
        self.path = ReaderPath(self.ccfg, block_size=bs, tp_size=1, total_kv_heads=kv.HEADS, reader_id=self.name,
                               hot=self.hot, bg=self.bg, stats=self.stats,
                               hasher=lambda req_id, salt: IncrementalHasher(C, kv.ROOT), own_node=lambda: None)
        self.path.set_local_layouts({0: layout})
        self.reasons = _FailReasons()
        logging.getLogger("pdxfer").addHandler(self.reasons)
        self.n = 0

    def once(self) -> None:
        cfg, C = self.cfg, self.cfg.chunk_tokens
        p = self.rng.randrange(cfg.prompts)
        tokens = self.prompts[p]
        req = f"{self.name}-{self.n}"
        self.n += 1
        kind = "normal"
        # The lock TTL is read from the config at each lookup: a short-TTL request swaps in a copy.
        self.path.cfg = self.ccfg
        if self.rng.random() < cfg.short_ttl_p:  # a lock that expires under the read
            kind = "short_ttl"
            self.path.cfg = dataclasses.replace(self.ccfg, lock_ttl_s=self.rng.uniform(0.001, 0.02))
        errors0 = self.stats.master_errors
        t = Timed()
        hit, _ = self.path.get_num_new_matched_tokens(req, tokens, len(tokens), 0, None)
        self.log.write("lookup", keys=len(tokens) // C, ok=self.stats.master_errors == errors0, hit=hit or 0,
                       **t.fields())
        if not hit:
            self.path.finish_request(req)
            return
        lk = self.path._lookups.get(req)  # what the plan is made from (logged with the load)
        blocks = self.rng.sample(range(self.num_blocks), self.req_blocks)
        kv.fill_blocks(self.phys, self.side, blocks)
        rec: dict[str, Any] = {"req": req, "prompt": p, "kind": kind, "hit": hit, "lookup_t0": t.w0,
                               "locations": [[loc.node_id, list(loc.block_ids)] for loc in lk.locations] if lk else [],
                               "split_blocks": split_blocks(lk, C) if lk else 0}
        self.path.update_state_after_alloc(req, blocks, hit)
        meta = self.path.take_metadata()
        if cfg.broken_grouping and lk is not None and meta.loads:
            meta = self._break(meta, lk, blocks)
        spec = meta.loads[0] if meta.loads else None
        rec["lock"] = spec.lock_id if spec else None
        rec["reads"] = [self._describe(r, spec) for r in spec.reads] if spec else []
        t = Timed()
        self.worker.start_loads(meta)
        done = False
        # Bounded: the worker's own bounds end every load (a read that never stops, at its stop
        # bound); past ours the checker reports the wait, then the blocks are left alone.
        deadline = time.monotonic() + self.worker._stop_bound_s + load_bound(cfg) + 5.0
        while time.monotonic() < deadline:
            if req in self.worker.get_finished():
                done = True
                break
            time.sleep(0.002)
        failed = self.worker.take_load_errors() & set(blocks)
        rec["rounds"] = [x for x in self.worker.round_log if x["req"] == req]
        self.worker.round_log.clear()
        rec["blocks"], rec["block_size"] = blocks, self.side.block_size
        rec["load"] = {"done": done, "ok": done and not failed, "err": self.reasons.reasons.pop(req, None),
                       **t.fields()}
        if rec["load"]["ok"]:
            got = kv.read_tokens(self.phys, self.side, blocks, 0, hit)
            rec["check"] = kv.check_tokens(got, tokens, {q: v for q, v in self.prompts.items() if q != p})
        self.path.finish_request(req)
        self.log.write("kvread", **rec)

    def _break(self, meta: PdxferConnectorMetadata, lk: Any, blocks: list[int]) -> PdxferConnectorMetadata:
        spec = meta.loads[0]
        bs = self.side.block_size
        if all(int(lk.nodes[loc.node_id].layout["block_size"]) == bs for loc in lk.locations):
            return meta  # one block size: the block-for-block plan, not the grouping under test
        reads = broken_reads(lk, blocks, self.cfg.chunk_tokens, bs)
        holders = tuple(HolderRef.of(lk.nodes[n]) for n in sorted({r.node_id for r in reads}))
        loads: list[LoadSpec] = [dataclasses.replace(spec, reads=reads, holders=holders), *meta.loads[1:]]
        return PdxferConnectorMetadata(loads=loads)

    def _describe(self, r: NodeRead, spec: LoadSpec) -> dict[str, Any]:
        fmt = spec.holder(r.node_id).layout.get("kv_format")
        how = ("token_range" if r.remote_block_size else "direct" if fmt == self.side.kv_format else "pairs")
        return {"node": r.node_id, "how": how, "remote": list(r.remote_blocks), "local": list(r.local_blocks),
                "remote_block_size": r.remote_block_size, "start": r.start, "tokens": r.num_tokens}

    def unreadable(self) -> list[str]:
        """Holders this reader looked at and refused (another format it cannot take)."""
        return sorted({node for (node, _), ok in self.path._usable.items() if not ok})

    def close(self) -> None:
        logging.getLogger("pdxfer").removeHandler(self.reasons)
        self.path.close()
        self.worker.close()
        self.hot.close()
        self.bg.close()
