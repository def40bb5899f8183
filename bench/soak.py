"""Soak: a prefill/decode pair under steady traffic for N minutes, with reader locks left to expire
at the master and the master killed and restarted every few minutes; every 10 s it samples each
process group's RSS, open fds (in all, and by kind: files, pipes, anon inodes, sockets by the
group at the other end; bench/proc_fds.py) and threads, the holders' held chunks and the master's
entries, locks and nodes, then fits a line to each series and reports its slope per hour. The fds
by kind are judged like the totals but kept out of the verdict: they say which kind grew.

Baseline, measured in the same run first: the same traffic through one plain `vllm serve` (no
connector) for --baseline-minutes, sampled the same way. vLLM's own growth (allocator warm-up,
caches) shows there; a pdxfer series is judged against its tolerance, and the plain instance's
RSS slope is printed next to the pair's so a trend vLLM has anyway is told apart from ours.

  python bench/soak.py --minutes 30 --json bench/results/soak.json

Traffic: one request at a time at a fixed pace (no two measured processes compete for a core
beyond what the pair itself does, and what is held does not follow the machine's speed), prompts
that share one of a few prefixes; every other one has a long fresh tail, so it goes through the
prefill and the decode reads it from there, the rest skip the prefill. An instance's held-chunk
gauge moves only when its engine steps, so the prefill must keep working for its series to mean
anything. The proxy's recent-prompt table is sized to fill during warm-up (--recent-prompt-tokens).
Locks: a side client holds a node of its own with published keys and takes a lock on them every
few seconds that it never releases (the master reaps it at its TTL). Restarts: SIGKILL, then
a new master on the same ports; the instances re-register and re-publish on their own.

Fds and threads move within a band of a few by design, which a line fitted over half an hour can
read as a slope: a master client keeps one connection per caller that used it at the same time
(socket:tcp->master; the master's socket:tcp<-<group>, so each incarnation starts with fewer), a
connection to a master that died is closed at the client's next call, a decode drops its two
connections to a holder after a failed load and makes them again at the next load, a holder cuts
a reader's connection idle for 10 minutes (one serving thread each: socket:tcp<-decode on the
prefill), and executor threads start at their first use. A leak grows one kind without bound;
the fds by kind say which.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pd_util import post_json, scrape  # noqa: E402
from bench.proc_fds import fd_targets, group_pids, kinds_by_group  # noqa: E402
from pdxfer.master import MasterClient, NodeInfo, start_local_master  # noqa: E402
from pdxfer.common.procs import free_port  # noqa: E402
from pdxfer.launch.fleet import Stack, start_fleet  # noqa: E402
from pdxfer.launch.serve_shim import served_model_name  # noqa: E402
from pdxfer.launch.tiny_model import make_tiny_model  # noqa: E402

# Allowed drift per hour, after warm-up: a series is flat when its fitted slope stays inside.
TOLERANCE = {"rss_mib": ("relative", 0.05), "fds": ("absolute", 4.0), "threads": ("absolute", 4.0),
             "held_chunks": ("relative_or", 0.10, 8.0), "master_entries": ("relative_or", 0.10, 8.0),
             "master_locks": ("absolute", 4.0), "master_nodes": ("absolute", 0.5),
             "recent_prompt_blocks": ("relative_or", 0.10, 8.0)}


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------


def group_usage(pgid: int) -> dict[str, float]:
    """RSS (MiB), open fds and threads summed over every live process of a process group."""
    rss_kib = fds = threads = 0
    for pid in group_pids(pgid):
        d = Path(f"/proc/{pid}")
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
                elif line.startswith("Threads:"):
                    threads += int(line.split()[1])
            fds += len(os.listdir(d / "fd"))
        except (OSError, ValueError, IndexError):
            continue  # the process went away while we looked
    return {"rss_mib": round(rss_kib / 1024, 2), "fds": fds, "threads": threads}


def held_chunks(url: str) -> float | None:
    """Chunks a holder holds now (its gauge); None when the instance does not export it."""
    try:
        return scrape(url).get("vllm:pdxfer_held_chunks")
    except OSError:
        return None


def proxy_sample(url: str) -> tuple[float | None, dict[str, float]]:
    """The router's recent-prompt table size, and requests so far by route reason."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None, {}
    blocks: float | None = None
    routes: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdxfer_proxy_recent_prompt_blocks "):
            blocks = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdxfer_proxy_routes_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            routes[reason] = routes.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return blocks, routes


def master_gauges(http_url: str) -> dict[str, float | None]:
    try:
        m = scrape(http_url)
    except OSError:
        return {"master_entries": None, "master_locks": None, "master_nodes": None}
    return {"master_entries": m.get("pdxfer_master_entries"), "master_locks": m.get("pdxfer_master_locks"),
            "master_nodes": m.get("pdxfer_master_nodes")}


def slope_per_hour(segments: list[list[tuple[float, float]]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour, pooled over segments that each
    keep their own level (a master restarted empty starts a new segment: its drop is no trend)."""
    num = den = 0.0
    n = 0
    for pts in segments:
        if len(pts) < 2:
            continue
        mt = statistics.fmean(t for t, _ in pts)
        mv = statistics.fmean(v for _, v in pts)
        num += sum((t - mt) * (v - mv) for t, v in pts)
        den += sum((t - mt) ** 2 for t, _ in pts)
        n += len(pts)
    if n < 3 or den == 0:
        return None
    return num / den * 3600.0


def judge(series: str, segments: list[list[tuple[float, float]]]) -> dict[str, Any]:
    s = slope_per_hour(segments)
    points = [p for seg in segments for p in seg]
    name = series.split(".", 1)[-1]
    kind, *lim = TOLERANCE["fds" if name.startswith("fd.") else name]  # a kind: as the total
    median = statistics.median(v for _, v in points) if points else 0.0
    if kind == "relative":
        allowed = lim[0] * abs(median)
    elif kind == "relative_or":
        allowed = max(lim[0] * abs(median), lim[1])
    else:
        allowed = lim[0]
    return {"slope_per_hour": None if s is None else round(s, 3), "median": round(median, 3),
            "allowed_per_hour": round(allowed, 3), "flat": s is not None and abs(s) <= allowed,
            "samples": len(points)}


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------


class Traffic(threading.Thread):
    """Requests through ``url`` one at a time at a fixed pace (``rate`` per second: what is held
    then does not follow the machine's speed), each a shared prefix (one of a few) and a fresh
    tail. Every ``long_every``-th tail is ``long_tail_tokens`` long, so more is left to compute
    than the router's skip threshold: those go through the prefill, whose holder then publishes,
    serves the decode's read and frees at retention, all soak long; the short ones skip it."""

    def __init__(self, url: str, model: str, vocab: int, prefix_tokens: int, rate: float = 2.0,
                 long_every: int = 2, long_tail_tokens: int = 300, seed: int = 3) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        rng = random.Random(seed)
        self.rng = rng
        self.vocab = vocab
        self.prefixes = [[rng.randrange(16, vocab) for _ in range(prefix_tokens)] for _ in range(6)]
        self.period = 1.0 / rate
        self.long_every, self.long_tail_tokens = long_every, long_tail_tokens
        self.ok = self.failed = self.late = 0
        self.last_error = ""
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        next_at = time.monotonic()
        while not self.stop.is_set():
            n += 1
            tail = self.long_tail_tokens if self.long_every and n % self.long_every == 0 else 24
            prompt = self.rng.choice(self.prefixes) + [self.rng.randrange(16, self.vocab) for _ in range(tail)]
            try:
                post_json(self.url + "/v1/completions",
                          {"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)
                self.ok += 1
            except (OSError, RuntimeError, ValueError) as exc:
                self.failed += 1
                self.last_error = str(exc)[:200]
                self.stop.wait(1.0)
            next_at += self.period
            wait = next_at - time.monotonic()
            if wait < 0:
                self.late += 1  # slower than the pace: start the next one now, without a burst
                next_at = time.monotonic()
            else:
                self.stop.wait(wait)


class GhostLocker(threading.Thread):
    """A node of its own with published keys, locked every ``every_s`` and never released."""

    def __init__(self, address: str, every_s: float = 3.0, ttl_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.address, self.every_s, self.ttl_s = address, every_s, ttl_s
        self.keys = [os.urandom(32) for _ in range(16)]
        self.locks = self.errors = 0
        self.stop = threading.Event()

    def _register(self, c: MasterClient) -> None:
        c.register_node(NodeInfo("soak-ghost", 0, "tcp", b"none", {"v": 1, "block_size": 16}, "soak"), 30)
        c.publish("soak-ghost", [(k, [i]) for i, k in enumerate(self.keys)])

    def run(self) -> None:
        c = MasterClient(self.address, timeout_s=2.0)
        registered = False
        while not self.stop.wait(self.every_s):
            try:
                if not registered or not c.heartbeat("soak-ghost"):
                    self._register(c)
                    registered = True
                r = c.lookup_and_lock(self.keys, reader="soak-ghost-reader", lock_ttl_s=self.ttl_s)
                if r.hit_chunks == 0:
                    registered = False  # the master restarted and forgot us
                else:
                    self.locks += 1
            except Exception:  # a master being restarted: try again next round
                self.errors += 1
                registered = False
        c.close()


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


def sample_loop(groups: dict[str, int], holders: dict[str, str], master_http: str | None, minutes: float,
                sample_s: float, on_tick: Any = None, proxy: str | None = None) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    while True:
        now = time.monotonic()
        row: dict[str, Any] = {"t": round(now - t0, 1)}
        for name, pgid in groups.items():
            for k, v in group_usage(pgid).items():
                row[f"{name}.{k}"] = v
        row["fd_kinds"] = kinds_by_group({name: fd_targets(group_pids(pgid)) for name, pgid in groups.items()})
        for name, url in holders.items():
            row[f"{name}.held_chunks"] = held_chunks(url)
        if master_http is not None:
            row.update(master_gauges(master_http))
        if proxy is not None:
            row["proxy.recent_prompt_blocks"], row["routes"] = proxy_sample(proxy)
        samples.append(row)
        if on_tick is not None:
            on_tick(row)
        if now >= end:
            return samples
        time.sleep(max(0.0, min(sample_s, end - time.monotonic())))


def fd_kind_series(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fds by kind as series of their own (``<group>.fd.<kind>``, 0 where a sample lacks the
    kind while its group was sampled), for :func:`analyse`."""
    seen = {(g, k) for row in samples for g, kinds in row.get("fd_kinds", {}).items() for k in kinds}
    out = []
    for row in samples:
        by_group = row.get("fd_kinds", {})
        out.append({"t": row["t"], **{f"{g}.fd.{k}": by_group[g].get(k, 0) for g, k in seen if g in by_group}})
    return out


def analyse(samples: list[dict[str, Any]], warmup_s: float, restarts: list[float] = ()) -> dict[str, Any]:
    """Trend of every numeric series after ``warmup_s``; the master's own series are cut into one
    segment per incarnation (each judged after half a warm-up of its own)."""
    keys = sorted({k for row in samples for k, v in row.items() if k != "t" and isinstance(v, (int, float))})
    out = {}
    for k in keys:
        pts = [(row["t"], float(row[k])) for row in samples if row["t"] >= warmup_s and row.get(k) is not None]
        if k.startswith("master") and restarts:
            cuts = [0.0, *restarts, float("inf")]
            segs = [[(t, v) for t, v in pts if a + warmup_s / 2 <= t < b] for a, b in zip(cuts, cuts[1:])]
        else:
            segs = [pts]
        out[k] = judge(k, segs)
    return out


def run_baseline(model_dir: Path, model: str, vocab: int, log_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack()
    try:
        url = stack.add_vllm("plain", model_dir, log_dir, None, None, ["--dtype", "float32"],
                             {"VLLM_CPU_KVCACHE_SPACE": "1"}, die_with_parent=True)
        stack.wait_ready(args.ready_timeout)
        traffic = Traffic(url, model, vocab, args.prefix_tokens, args.rate, args.long_every, args.long_tail_tokens)
        traffic.start()
        groups = {"plain": stack["plain"].proc.pid}
        samples = sample_loop(groups, {}, None, args.baseline_minutes, args.sample_s,
                              lambda r: print(f"  plain t={r['t']:7.1f}s rss={r['plain.rss_mib']} MiB", flush=True))
        traffic.stop.set()
        traffic.join(70)
        return {"minutes": args.baseline_minutes, "requests_ok": traffic.ok, "requests_failed": traffic.failed,
                "requests_behind_pace": traffic.late,
                "trends": analyse(samples, args.warmup_s),
                "fd_kind_trends": analyse(fd_kind_series(samples), args.warmup_s), "samples": samples}
    finally:
        stack.stop(10)


def run_pair(model_dir: Path, model: str, vocab: int, log_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, http_port = free_port(), free_port()
    margs = ["--port", str(port), "--http-port", str(http_port)]

    def new_master() -> Any:
        return start_local_master(workdir=log_dir, log_name="master.log", extra_args=margs, die_with_parent=True)

    master = new_master()
    stack, proxy = start_fleet(model_dir, log_dir, master=master.address, vllm_args=["--dtype", "float32"],
                               connector_extra={"lock_ttl_s": args.lock_ttl_s, "retention_s": args.retention_s},
                               prefill_cpus=[None], decode_cpus=[None], die_with_parent=True,
                               proxy_args=["--recent-prompt-tokens", str(args.recent_prompt_tokens)])
    restarts: list[float] = []
    try:
        stack.wait_ready(args.ready_timeout)
        traffic = Traffic(proxy, model, vocab, args.prefix_tokens, args.rate, args.long_every,
                          args.long_tail_tokens)
        ghost = GhostLocker(master.address)
        traffic.start()
        ghost.start()
        holders = {c.name: c.url for c in stack.components if c.name.startswith(("prefill", "decode"))}
        groups = {c.name: c.proc.pid for c in stack.components}
        t0 = time.monotonic()
        next_restart = t0 + args.restart_every_min * 60

        def tick(row: dict[str, Any]) -> None:
            nonlocal master, next_restart
            print(f"  pair t={row['t']:7.1f}s rss P={row.get('prefill.rss_mib')} D={row.get('decode.rss_mib')} "
                  f"M={row.get('master.rss_mib')} entries={row.get('master_entries')} locks={row.get('master_locks')} "
                  f"ok={traffic.ok} failed={traffic.failed}", flush=True)
            # No restart in the last minute: the new incarnation would have nothing to judge.
            if time.monotonic() >= next_restart and time.monotonic() < t0 + args.minutes * 60 - 60:
                master.proc.kill()  # SIGKILL and reap
                master = new_master()
                groups["master"] = master.proc.pid
                restarts.append(round(time.monotonic() - t0, 1))
                next_restart += args.restart_every_min * 60
                print(f"  master restarted at t={restarts[-1]}s", flush=True)

        groups["master"] = master.proc.pid
        samples = sample_loop(groups, holders, f"http://127.0.0.1:{http_port}", args.minutes, args.sample_s, tick,
                              proxy=proxy)
        traffic.stop.set()
        ghost.stop.set()
        traffic.join(70)
        ghost.join(10)
        trends = analyse(samples, args.warmup_s, restarts)
        return {"minutes": args.minutes, "requests_ok": traffic.ok, "requests_failed": traffic.failed,
                "requests_behind_pace": traffic.late, "last_error": traffic.last_error,
                "ghost_locks_left_to_expire": ghost.locks, "ghost_errors": ghost.errors, "master_restarts_at_s": restarts, "trends": trends,
                "fd_kind_trends": analyse(fd_kind_series(samples), args.warmup_s, restarts),
                "samples": samples}
    finally:
        stack.stop(10)
        master.proc.stop(10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the pair's run")
    p.add_argument("--baseline-minutes", type=float, default=None,
                   help="length of the plain instance's run (default: a third of --minutes, at least 3)")
    p.add_argument("--restart-every-min", type=float, default=5.0, help="minutes between master restarts")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=120.0, help="samples before this are not judged")
    p.add_argument("--lock-ttl-s", type=float, default=10.0, help="the decode's lock TTL")
    p.add_argument("--retention-s", type=float, default=20.0, help="how long the prefill holds chunks")
    p.add_argument("--prefix-tokens", type=int, default=384, help="tokens of each shared prefix")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second, one at a time")
    p.add_argument("--long-every", type=int, default=2,
                   help="every Nth request has a long unique tail and goes through the prefill (0: none)")
    p.add_argument("--long-tail-tokens", type=int, default=300, help="tokens of a long tail")
    p.add_argument("--recent-prompt-tokens", type=int, default=8192,
                   help="the proxy's recent-prompt table, per instance: small enough that this traffic "
                        "fills it during warm-up (a bounded table filling is growth, not a leak; at the "
                        "default size it would fill for hours)")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    a = p.parse_args(argv)
    if a.baseline_minutes is None:
        a.baseline_minutes = max(3.0, a.minutes / 3)
    for name in ("minutes", "sample_s", "restart_every_min", "rate"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdxfer-soak-"))
    model_dir = args.model or make_tiny_model(work / "tiny")
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg.get("vocab_size", 1000))
    model = served_model_name(model_dir)
    print(f"soak: logs in {work}; load avg {os.getloadavg()[0]:.2f}", flush=True)
    print(f"== baseline: plain vLLM, {args.baseline_minutes} min", flush=True)
    base = run_baseline(model_dir, model, vocab, work / "plain", args)
    print(f"== pdxfer pair, {args.minutes} min, master restart every {args.restart_every_min} min", flush=True)
    pair = run_pair(model_dir, model, vocab, work / "pair", args)
    trends = pair["trends"]
    flat = all(v["flat"] for v in trends.values() if v["samples"] >= 3)
    base_rss = base["trends"].get("plain.rss_mib", {}).get("slope_per_hour")
    print(f"\n{'series':28s} {'slope/h':>10s} {'allowed/h':>10s} {'median':>10s} flat")
    for k, v in trends.items():
        print(f"{k:28s} {v['slope_per_hour']!s:>10s} {v['allowed_per_hour']!s:>10s} {v['median']!s:>10s} {v['flat']}")
    grown = {k: v for k, v in pair["fd_kind_trends"].items() if v["samples"] >= 3 and not v["flat"]}
    for k, v in grown.items():
        print(f"  fds by kind, not flat: {k:40s} {v['slope_per_hour']!s:>10s}/h (median {v['median']})")
    print(f"baseline plain rss slope/h {base_rss}; pair requests ok {pair['requests_ok']} failed "
          f"{pair['requests_failed']}; master restarts at {pair['master_restarts_at_s']}")
    print(f"every trend flat: {flat}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "soak", "load_avg_at_start": os.getloadavg(),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "every_trend_flat": flat, "baseline": base, "pair": pair}, indent=1))
        print(f"wrote {args.json}")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
