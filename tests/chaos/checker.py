"""The history checker: reads every process's JSON-lines log after a run and reports violations.

1. Never wrong bytes: every read whose ``release()`` returned True saw, for each chunk, a block
   whose stamp is intact (body matches stamp), names the block the master gave, and names a
   generation that the stamp's holder wrote for exactly that key (else: stale, foreign, torn,
   unknown).
2. Never hang: every logged wait (lookup, read, release, publish, unpublish) took at most its
   bound (client timeout or read timeout, plus slack), except a process's own ops overlapping a
   SIGSTOP of that process (the freeze is not a wait).
3. Never leak: after the quiet period no lock is left at any master, the leader lists exactly as
   many entries as the holders still hold (0 after retention), every process that was not killed
   wrote its final report, and its open fds and threads came back to where they started.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

from tests.chaos.common import ChaosConfig


def _records(logdir: str) -> Iterator[dict[str, Any]]:
    for path in sorted(glob.glob(os.path.join(logdir, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line of a SIGKILLed process may be cut short


def check(logdir: str, cfg: ChaosConfig, stats: list[dict] | None) -> dict[str, Any]:
    return check_records(list(_records(logdir)), cfg, stats)


def check_records(recs: list[dict[str, Any]], cfg: ChaosConfig, stats: list[dict] | None,
                  repull: bool = True) -> dict[str, Any]:
    """The checker over records already read. Also what a run's end condition looks at while it
    runs (``stats=None``: the leak checks mean nothing yet; ``repull=False`` skips the costly
    token-by-token replay of re-pulls, which no end condition needs)."""
    violations: list[dict[str, Any]] = []
    vcount: Counter[str] = Counter()

    suspects: Counter[str] = Counter()

    def violate(kind: str, **detail: Any) -> None:
        vcount[kind] += 1
        if "suspect" in detail:
            suspects[detail["suspect"]] += 1
        if vcount[kind] <= 20:  # up to 20 examples of each kind
            violations.append({"kind": kind, **detail})

    # What each generation is: (holder index, incarnation, block, gen) -> key; holder -> node id.
    gens: dict[tuple[int, int, int, int], str] = {}
    node_of: dict[tuple[int, int], str] = {}
    freezes: dict[str, list[tuple[float, float]]] = {}
    faults: Counter[str] = Counter()
    finals: dict[str, dict] = {}
    started: dict[str, dict] = {}
    killed: set[str] = set()
    ops: Counter[str] = Counter()
    # For naming the likely cause of a stale read: publishes that timed out (maybe applied
    # later) and frees, per (holder, incarnation) and (key, block, gen).
    timed_out: set[tuple[int, int, str, int, int]] = set()
    republished: set[tuple[int, int, str, int, int]] = set()
    freed: dict[tuple[int, int, str, int, int], tuple[str, float]] = {}  # -> (why, when)
    hi_of: dict[str, tuple[int, int]] = {}
    for r in recs:
        op = r["op"]
        if op == "start" and "node" in r:
            hi_of[r["proc"]] = (r["holder"], r["inc"])
        elif op in ("publish", "republish", "free") and r["proc"] in hi_of:
            h, i = hi_of[r["proc"]]
            for k, b, g in r["entries"]:
                b = tuple(b) if isinstance(b, list) else b  # kv mode: a chunk's location is several blocks
                if op == "republish":
                    if r["ok"]:
                        republished.add((h, i, k, b, g))
                elif op == "free":
                    freed[(h, i, k, b, g)] = (r["why"], r["wall"])
                elif not r["ok"] and not r.get("refused"):
                    timed_out.add((h, i, k, b, g))

    def suspect(key: str, node: str, block: int, stamp_holder: int, read_t0: float) -> str:
        if stamp_holder >= 100:
            return "hole 2: a second process registered this node id"
        # This key's frees of this block, the last one before the read first: with few blocks a
        # block is freed for one key many times over, for different reasons.
        frees = sorted(((when, why, (h, i, k, b, g)) for (h, i, k, b, g), (why, when) in freed.items()
                        if k == key and b == block and node_of.get((h, i)) == node),
                       key=lambda x: (x[0] > read_t0, -x[0]))
        for _, why, (h, i, k, b, g) in frees:
            late = (h, i, k, b, g) in timed_out
            if late and why == "unpublished":
                return "hole 1: a publish that timed out arrived after unpublish said gone"
            if late and why == "master_lost":
                return "hole 1: force-freed ('master lost') while a timed-out publish was in flight"
            if why == "publish_refused" and (h, i, k, b, g) in republished:
                return ("hole 1 (variant): the re-publish after re-registration stored a key whose "
                        "own publish was then refused (unknown node) and its block freed")
            if why == "never_confirmed":
                return "hole 6: freed by the holder's own lock-TTL bound while a longer lock held it"
            if why == "master_lost":
                return "force-freed ('master lost') while the master still served it"
            if why == "moved":
                return "a move's old block freed while the master still served it (the move was not accepted)"
            if why == "unsafe_early_free":
                return "freed before its unpublish (the broken holder of unsafe_free)"
        return "unknown"

    for r in recs:
        op = r["op"]
        if op == "write" and "block" in r:  # kv mode writes are checked by their pattern instead
            gens[(r["holder"], r["inc"], r["block"], r["gen"])] = r["key"]
        elif op == "start" and "node" in r:
            node_of[(r["holder"], r["inc"])] = r["node"]
        if op == "start":
            started[r["proc"]] = r
        elif op == "final":
            finals[r["proc"]] = r
        elif op == "fault":
            faults[r["kind"]] += 1
            if r["kind"] == "holder_freeze":
                freezes.setdefault(r["target"], []).append((r["t0"], r["t1"]))
            if r["kind"] in ("holder_kill",):
                killed.add(r["target"])
            if r["kind"] == "node_id_clash":
                killed.add(r["target"])
        elif op in ("read", "kvread") and r.get("kind") in ("short_ttl", "sleep_past_ttl"):
            faults["lock_expire"] += 1
        if r["proc"] != "harness" and op in ("lookup", "read", "kvread", "publish", "republish", "unpublish"):
            ops[op] += 1

    # ---- 1. validated reads -----------------------------------------------------------------
    validated = validated_chunks = releases_false = release_errors = read_errors = 0
    for r in recs:
        if r["op"] != "read":
            continue
        rel = r["release"]
        if r["read"]["err"]:
            read_errors += 1
        if rel["valid"] is None:
            release_errors += 1
            continue
        if not rel["valid"]:
            releases_false += 1
            continue
        if r["read"]["err"]:
            continue  # the reader already discards a failed read; release True does not matter
        validated += 1
        for (key, node, blocks), seen in zip(r["locations"], r["seen"]):
            validated_chunks += 1
            ctx = {"proc": r["proc"], "lock": r["lock"], "key": key, "node": node, "block": blocks[0],
                   "seen": seen, "read_t0": r["read"]["t0"], "release_t1": rel["t1"]}
            st = seen["stamp"]
            if st is None:
                violate("garbage", **ctx)
                continue
            holder, inc, block, gen = st
            if not seen["ok"]:
                violate("torn", **ctx)
            elif block != blocks[0]:
                violate("wrong_block", **ctx)
            elif node_of.get((holder, inc), node) != node:
                violate("foreign", stamp_node=node_of.get((holder, inc)), suspect="holder restarted?", **ctx)
            elif (holder, inc, block, gen) not in gens:
                violate("unknown_generation", **ctx)
            elif gens[(holder, inc, block, gen)] != key:
                violate("stale", stamp_key=gens[(holder, inc, block, gen)],
                        suspect=suspect(key, node, block, holder, r["read"]["t0"]), **ctx)

    # ---- 1a. heterogeneous loads (kv mode): token by token against the pattern --------------
    kv = kv_summary(recs)
    for r in recs:
        if r["op"] != "kvread" or not r["load"]["ok"]:
            continue
        validated += 1
        validated_chunks += len(r["locations"])
        for v in (repull_violations(r) if repull else ()):
            violate(v.pop("kind"), proc=r["proc"], req=r["req"], **v)
        if r["check"]["bad"]:
            violate("wrong_kv", proc=r["proc"], req=r["req"], prompt=r["prompt"], hit=r["hit"],
                    bad_tokens=r["check"]["bad"], bad_ranges=r["check"].get("bad_ranges"),
                    locations=r["locations"], reads=r["reads"], lock=r["lock"])
    for r in recs:
        if r["op"] == "kvread" and not r["load"]["ok"]:
            err = r["load"]["err"] or ""
            if "lock expired" in err or "refused the release" in err:
                releases_false += 1
            else:
                read_errors += 1

    # ---- 1b. recovery: once the faults are over (and a lease later), reads must work again ----
    window = [r["wall"] for r in recs if r["op"] == "recovery_window"]
    recovery_reads = recovery_failures = 0
    recovery_examples: list[dict[str, Any]] = []
    if window:
        for r in recs:
            if r["op"] == "kvread" and r["lookup_t0"] >= window[0] and r["kind"] == "normal":
                recovery_reads += 1
                if not r["load"]["ok"]:
                    recovery_failures += 1
                    if len(recovery_examples) < 5:
                        recovery_examples.append({"proc": r["proc"], "err": r["load"]["err"],
                                                  "nodes": sorted({n for n, _ in r["locations"]})})
            if r["op"] == "read" and r["lookup_t0"] >= window[0]:
                recovery_reads += 1
                if r["read"]["err"]:
                    recovery_failures += 1
                    if len(recovery_examples) < 5:
                        recovery_examples.append({"proc": r["proc"], "err": r["read"]["err"],
                                                  "nodes": sorted({n for _, n, _ in r["locations"]})})

    # ---- 2. bounded waits -----------------------------------------------------------------------
    master_bound = cfg.master_timeout_s + cfg.wait_slack_s
    bounds = {"lookup": master_bound, "publish": master_bound, "unpublish": master_bound,
              "republish": master_bound}
    slow = []

    def frozen_during(proc: str, t0: float, t1: float) -> bool:
        return any(a < t1 and t0 < b for a, b in freezes.get(proc, []))

    for r in recs:
        items: list[tuple[str, dict]] = []
        if r["op"] in bounds and "dur" in r:
            items.append((r["op"], r))
        elif r["op"] == "read":
            items += [("read", r["read"]), ("release", r["release"])]
        elif r["op"] == "kvread":
            items.append(("load", r["load"]))
        for what, t in items:
            bound = cfg.read_timeout_s + cfg.wait_slack_s if what == "read" else master_bound
            if what == "load":  # connect + read + the validating release, as the worker bounds them
                bound = min(1.0, cfg.read_timeout_s) + cfg.read_timeout_s + cfg.master_timeout_s + cfg.wait_slack_s
            if t["dur"] > bound and not frozen_during(r["proc"], t["t0"], t["t1"]):
                violate("wait_bound", proc=r["proc"], what=what, dur=round(t["dur"], 3), bound=bound)
                slow.append(t["dur"])

    # ---- 3. leaks -------------------------------------------------------------------------------
    leaks: dict[str, Any] = {}
    stats = stats or []
    if not stats:
        violate("no_master_stats")
    leaks["locks"] = sum(s.get("locks", 0) for s in stats)
    if leaks["locks"]:
        violate("leaked_locks", stats=[{k: s.get(k) for k in ("port", "locks", "entries", "leader")} for s in stats])
    held = sum(f.get("held_keys", 0) for p, f in finals.items() if p.startswith("holder"))
    leaks["held_blocks"] = sum(f.get("held_blocks", 0) for p, f in finals.items() if p.startswith("holder"))
    leaks["master_entries"] = sum(s.get("entries", 0) for s in stats)
    if leaks["master_entries"] != held:
        violate("entries_mismatch", master_entries=leaks["master_entries"], holders_hold=held)
    if leaks["held_blocks"]:
        violate("leaked_blocks", held_blocks=leaks["held_blocks"])
    missing = sorted(p for p in started if p not in finals and p not in killed and not p.startswith("dup"))
    if missing:
        violate("no_final_report", procs=missing)
    fd_leaks = {p: (f["fds_start"], f["fds_end"]) for p, f in finals.items() if f["fds_end"] > f["fds_start"]}
    thread_leaks = {p: (f["threads_start"], f["threads_end"]) for p, f in finals.items()
                    if f["threads_end"] > f["threads_start"]}
    leaks["fds"], leaks["threads"] = fd_leaks, thread_leaks
    if fd_leaks:
        violate("fd_leak", procs=fd_leaks)
    if thread_leaks:
        violate("thread_leak", procs=thread_leaks)

    return {
        "validated_reads": validated,
        "validated_chunks": validated_chunks,
        "releases_false": releases_false,
        "release_errors": release_errors,
        "read_errors": read_errors,
        "operations": sum(ops.values()),
        "operations_by_kind": dict(ops),
        "faults": dict(sorted(faults.items())),
        "faults_total": sum(faults.values()),
        "violations": sum(vcount.values()),
        "violations_by_kind": dict(vcount),
        "recovery_reads": recovery_reads,
        "recovery_failures": recovery_failures,
        "recovery_examples": recovery_examples,
        "violation_suspects": dict(suspects),
        "violation_examples": violations,
        "leaks": leaks,
        "processes": len(started),
        "kv": kv,
        "fault_effects": fault_effects(recs, cfg),
        "faults_met": faults_met(recs),
    }


class _Spans:
    """Time spans, asked whether any of them overlaps a given one (sorted starts, running max of ends)."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        spans.sort()
        self.t0s = [a for a, _ in spans]
        self.max_t1: list[float] = []
        for _, b in spans:
            self.max_t1.append(max(b, self.max_t1[-1]) if self.max_t1 else b)

    def overlaps(self, t0: float, t1: float) -> bool:
        i = bisect.bisect_left(self.t0s, t1)  # spans that started before the end
        return i > 0 and self.max_t1[i - 1] > t0


MASTER_CALLS = ("lookup", "publish", "unpublish", "republish", "move")
HOLDER_CALLS = ("publish", "unpublish", "republish", "move")


def faults_met(recs: list[dict[str, Any]]) -> dict[str, int]:
    """Per fault kind, how many injected faults met the work: something was in flight while the
    fault lasted that it could touch. A holder killed (until its next process registered) or
    frozen: a read that named its node, one of its own calls (frozen), or a lookup answered (the
    index answers with or without that holder's entries); a master, its link or etcd killed,
    frozen, cut or delayed: a call to a master, of any process; a node-id clash: the live holder
    it displaced (superseded after the clash began); a lock expiry: the release it made refused.
    A fault that met nothing tested nothing, however many were injected."""
    node_of: dict[str, str] = {}
    starts: dict[str, list[float]] = {}  # node -> when each of its processes registered
    reads: dict[str, list[tuple[float, float]]] = {}
    own: dict[str, list[tuple[float, float]]] = {}
    calls: list[tuple[float, float]] = []
    answered: list[tuple[float, float]] = []  # lookups that hit
    superseded: dict[str, list[float]] = {}
    met: Counter[str] = Counter()
    for r in recs:
        op = r["op"]
        if op == "start" and "node" in r:
            node_of[r["proc"]] = r["node"]
            starts.setdefault(r["node"], []).append(r["wall"])
        elif op == "superseded":
            superseded.setdefault(r["proc"], []).append(r["wall"])
        elif op == "read":
            span = (r["lookup_t0"], r["release"]["t1"])
            for node in {n for _, n, _ in r["locations"]}:
                reads.setdefault(node, []).append(span)
            calls.append((r["release"]["t0"], r["release"]["t1"]))
            if r.get("kind") in ("short_ttl", "sleep_past_ttl") and r["release"]["valid"] is False:
                met["lock_expire"] += 1
        elif op == "kvread":
            span = (r["lookup_t0"], r["load"]["t1"])
            for node in {n for n, _ in r["locations"]}:
                reads.setdefault(node, []).append(span)
            err = r["load"]["err"] or ""
            if r.get("kind") == "short_ttl" and ("lock expired" in err or "refused the release" in err):
                met["lock_expire"] += 1
        elif op == "lookup" and r["ok"] and r.get("hit"):
            answered.append((r["t0"], r["t1"]))
        if op in MASTER_CALLS and "t1" in r and r["proc"] != "harness":
            calls.append((r["t0"], r["t1"]))
            if op in HOLDER_CALLS:
                own.setdefault(r["proc"], []).append((r["t0"], r["t1"]))
    read_spans = {n: _Spans(v) for n, v in reads.items()}
    own_spans = {p: _Spans(v) for p, v in own.items()}
    call_spans, answer_spans = _Spans(calls), _Spans(answered)
    for r in recs:
        if r["op"] != "fault":
            continue
        kind, a, b = r["kind"], r["t0"], r["t1"]
        if kind in ("holder_kill", "holder_freeze"):
            node = node_of.get(r["target"], "")
            if kind == "holder_kill":  # the dead process's entries are served until the next one registers
                b = max(b, min((t for t in starts.get(node, ()) if t > a), default=b))
            hit = (node in read_spans and read_spans[node].overlaps(a, b)) or answer_spans.overlaps(a, b)
            if kind == "holder_freeze" and r["target"] in own_spans:
                hit = hit or own_spans[r["target"]].overlaps(a, b)
        elif kind == "node_id_clash":
            hit = any(t >= a for t in superseded.get(r.get("node_of", ""), ()))
        else:
            hit = call_spans.overlaps(a, b)
        met[kind] += 1 if hit else 0
    return dict(sorted(met.items()))


def fault_effects(recs: list[dict[str, Any]], cfg: ChaosConfig) -> dict[str, int]:
    """Evidence that a fault met the work, for scenarios that must show more than "no violation":
    publishes that timed out on the holder (a link delay beyond the client timeout), holders
    displaced by a second process of their node id and publishes that process got through, and
    slow readers' validated long locks under which a holder asked to unpublish their key and was
    told it was still locked; moves by outcome, and validated reads of a key's old block whose
    lock overlapped a move of that key the master refused because a lock pinned it; and
    ``pinned_blocks_reused``: old blocks of refused moves rewritten for another key at once
    (``reuse_at_once`` after the broken holder's free)."""
    out = {"link_delays_beyond_timeout": 0, "publishes_timed_out": 0, "holders_superseded": 0,
           "clash_publishes": 0, "long_locks_met_unpublish": 0, "moves_moved": 0, "moves_pinned": 0,
           "moves_failed": 0, "moves_unknown": 0, "locks_met_move": 0, "pinned_blocks_reused": 0}
    # (node, key) -> (sent, answered, old block) of each move refused under a lock
    pinned_moves: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    hi_of: dict[str, tuple[int, int]] = {}
    node_of: dict[str, str] = {}
    refused: dict[tuple[str, str], list[float]] = {}  # (node, key) -> times an unpublish found it locked
    for r in recs:
        op = r["op"]
        if op == "fault" and r["kind"] == "link_delay" and r.get("delay", 0) > cfg.master_timeout_s:
            out["link_delays_beyond_timeout"] += 1
        elif op == "write" and r.get("reuse") == "pinned":
            out["pinned_blocks_reused"] += 1
        elif op == "start" and "node" in r:
            hi_of[r["proc"]] = (r["holder"], r["inc"])
            node_of[r["proc"]] = r["node"]
        elif op == "superseded":
            out["holders_superseded"] += 1
        elif op == "publish" and not r["ok"] and not r.get("refused"):
            out["publishes_timed_out"] += 1
        elif op == "publish" and r["ok"] and r["proc"].startswith("dup") and r.get("accepted"):
            out["clash_publishes"] += 1
        elif op == "unpublish" and r["ok"]:
            for k in set(r["keys"]) - set(r["gone"]):
                refused.setdefault((node_of.get(r["proc"], ""), k), []).append(r["t1"])
        elif op == "move":
            out[f"moves_{r['outcome']}"] += 1
            if r["outcome"] == "pinned":
                pinned_moves.setdefault((r["node"], r["key"]), []).append((r["t0"], r["t1"], r["old"][0]))
    for r in recs:
        if r["op"] != "read" or not r["release"]["valid"] or r["read"]["err"]:
            continue
        a, b = r["lookup_t0"], r["release"]["t1"]
        # The refusal happened between the move's send and answer, while the lock was valid.
        if any(a < t1 and t0 < b and old == blocks[0] for key, node, blocks in r["locations"]
               for t0, t1, old in pinned_moves.get((node, key), [])):
            out["locks_met_move"] += 1
    for r in recs:
        if r["op"] != "read" or r.get("kind") != "long_ttl" or not r["release"]["valid"] or r["read"]["err"]:
            continue
        a, b = r["lookup_t0"], r["release"]["t1"]
        if any(a <= t <= b for key, node, _ in r["locations"] for t in refused.get((node, key), [])):
            out["long_locks_met_unpublish"] += 1
    return out


def repull_violations(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """A validated load's rounds (its first read, then re-pulls from other holders): replay what
    each round's reads wrote, token by token (a whole-block read writes its blocks whole, a staged
    one exactly its tokens; a later round overwrites), and report every block of the hit whose last
    writers include a read that does not count: its round's lock was refused, or its holder's
    reads did not finish (``repull_mixed_block`` when two holders wrote the block,
    ``repull_invalid_source`` when one did). Empty for loads without a round log."""
    rounds, blocks, bs = rec.get("rounds"), rec.get("blocks"), rec.get("block_size")
    if not rounds or not blocks or not bs:
        return []
    where = {int(b): j for j, b in enumerate(blocks)}
    hit = int(rec["hit"])
    writer: dict[int, tuple[int, str, bool]] = {}  # request token -> (round, holder, counts)
    for rd in sorted(rounds, key=lambda x: x["round"]):
        bad = set(rd["incomplete"])
        for read in rd["reads"]:
            counts = bool(rd["valid"]) and read["node"] not in bad
            if read["staged"]:
                toks = range(read["start"], read["start"] + read["tokens"])
            else:
                toks = (where[int(b)] * bs + o for b in read["local"] for o in range(bs))
            for t in toks:
                if t < hit:
                    writer[t] = (rd["round"], read["node"], counts)
    out = []
    for j in range(-(-hit // bs)):
        ws = {writer[t] for t in range(j * bs, min((j + 1) * bs, hit)) if t in writer}
        if any(not c for _, _, c in ws):
            holders = sorted({(n, rnd, c) for rnd, n, c in ws})
            kind = "repull_mixed_block" if len({n for _, n, _ in ws}) > 1 else "repull_invalid_source"
            out.append({"kind": kind, "block": j, "writers": [{"node": n, "round": rnd, "counts": c}
                                                             for n, rnd, c in holders]})
    return out


def kv_summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the heterogeneous loads went through (empty without kv mode): loads by how each read
    went (direct, converted pairs, token range through staging), by holder block size, validated
    loads with a holder block split between two requests (the shape issue 16 hole 1 needs), and
    holders the readers refused."""
    reads: Counter[str] = Counter()
    holder_bs: Counter[str] = Counter()
    out: dict[str, Any] = {}
    loads = ok = split = repulled = 0
    unreadable: set[str] = set()
    formats: dict[str, str] = {}
    for r in recs:
        if r["op"] == "final" and "unreadable" in r:
            unreadable.update(r["unreadable"])
        if r["op"] != "kvread":
            continue
        loads += 1
        if not r["load"]["ok"]:
            continue
        ok += 1
        split += 1 if r["split_blocks"] else 0
        repulled += 1 if len(r.get("rounds") or ()) > 1 else 0
        for rd in r["reads"]:
            reads[rd["how"]] += 1
            holder_bs[str(rd["remote_block_size"] or "same")] += 1
    for r in recs:
        if r["op"] == "start" and "kv_format" in r:
            formats[r["proc"]] = f"{r['kv_format']}/{r['block_size']}"
    if loads:
        out = {"loads": loads, "loads_ok": ok, "reads_by_path": dict(reads), "reads_by_holder_block": dict(holder_bs),
               "split_block_loads": split, "repulled_loads": repulled, "unreadable_holders": sorted(unreadable), "readers": formats}
    return out
