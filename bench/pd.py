#!/usr/bin/env python3
"""P/D benchmark: plain recompute vs the pdxfer pair vs vLLM's NixlConnector pair, same run,
one configuration at a time, each instance on its own core.

Why one at a time: on a small machine two vLLM instances on one core slow each other down even
when their requests never overlap (a CPU worker keeps its core busy after a request; a plain
instance's 300-token TTFT went from 289 ms alone to 691-939 ms beside a prefill instance), and
NixlConnector's idle instances spin a core each. So:

  1. plain alone on the prefill core (nothing else of ours running)     -> recompute TTFT
  2. pdxfer-master + prefill (prefill core) + decode (decode core)      -> prefill- and decode-side
     TTFT, tokens the decode loaded, per-request transfer time; then decode TTFT with 1, 4 and 16
     requests at once (each its prefill then its decode, as the proxy does)
  3. NixlConnector pair on the same cores (kv_buffer_device cpu, num_threads 1), the same measures
  4. interleaved: the pdxfer pair plus a plain instance on the prefill core, requests alternating
     (ABBA) between plain and the pair, so prefill / plain is measured under the same drift

The decode's floor: on every plain instance, per length, one decode step (latency of
max_tokens 1+k minus max_tokens 1, paired, on a prompt already in its prefix cache) plus the HTTP
cost of a request (a one-token prompt's latency minus its own step); pdxfer decode TTFT / floor.

Each: start, wait (bounded) until ready, warm up (--warmup rounds over every length, not counted),
measure --prompts fresh random prompts per length (no prefix cache helps), measure concurrency,
then the idle CPU of every process group over --idle-seconds, stop, next. CPU used by other jobs
during each cell is recorded ("foreign"), so a cell measured under someone else's load shows it.
Every instance gets the same model, --dtype and --vllm-arg flags. Prints medians, minimums and
ratios; --json FILE writes everything, the command line included.

    PYTHONPATH=. .venv/bin/python bench/pd.py --json bench/results/pd.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pd_configs import (
    CONFIGS,
    DECODE_BYTES,
    DECODE_METRICS,
    EXTERNAL_HITS,
    Running,
    attempt,
    completion_ms,
    concurrent_batch,
    start_config,
)
from bench.pd_report import (
    PLAIN_AFTER,
    concurrency_rows,
    idle_summary,
    length_rows,
    print_summary,
    targets,
)
from bench.pd_util import (
    bench_model,
    CpuWindow,
    Prompts,
    delta,
    group_cpu_seconds,
    interleave_order,
    step_differences,
    hist_delta,
    idle_cpu,
    med,
    scrape,
    settle,
)
from pdxfer.common.procs import default_run_dir
from pdxfer.contracts.phase_times import PHASES
from pdxfer.transport import KINDS
from pdxfer.launch.plan import split_cores


def _progress() -> Any:
    last = [0.0]

    def show(rows: list[Any], elapsed: float) -> None:
        t = time.monotonic()
        if t - last[0] > 15:
            print(f"  [{elapsed:.0f}s] " + ", ".join(f"{r.name}: {r.text()}" for r in rows),
                  flush=True)
            last[0] = t

    return show


def _decode_snapshot(run: Running) -> dict[str, float]:
    return scrape(run.urls["decode"]) if "decode" in run.urls else {}


def _decode_delta(run: Running, before: dict[str, float], requests: int) -> dict[str, Any]:
    """What the decode instance's connector did since `before`: per-load transfer histogram and
    tokens loaded per request (connector counter, and vLLM's external prefix-cache hits)."""
    if "decode" not in run.urls or not requests:
        return {}
    hist, tokens = DECODE_METRICS[run.name]
    # Expect one transfer per request; wait (bounded) for late stats before reading.
    after = settle(run.urls["decode"], hist + "_count", before.get(hist + "_count", 0.0) + requests)
    out = {"load": hist_delta(after, before, hist),
           "tokens_loaded_per_request": round(delta(after, before, tokens) / requests, 1),
           "external_hits_per_request": round(delta(after, before, EXTERNAL_HITS) / requests, 1),
           "bytes_loaded_per_request": round(delta(after, before, DECODE_BYTES[run.name]) / requests)}
    for kind in ("full", "sliding"):  # a hybrid model's groups (pdxfer only)
        moved = delta(after, before, f"vllm:pdxfer_bytes_loaded_{kind}_total")
        if moved:
            out[f"bytes_loaded_{kind}_per_request"] = round(moved / requests)
    if run.name in ("pdxfer", "interleaved"):
        # Where the decode's TTFT went (pdxfer.contracts.phase_times): mean ms per request.
        out["phases_ms"] = {p: round(1000 * delta(after, before, f"vllm:pdxfer_phase_{p}_seconds_sum") / requests, 3)
                            for p in PHASES}
    return out


def measure_length(run: Running, n: int, args: argparse.Namespace, prompts: Prompts
                   ) -> dict[str, Any]:
    """--prompts sequential requests of n fresh tokens through the configuration."""
    before = _decode_snapshot(run)
    window = CpuWindow(run.pgids())
    samples: dict[str, list[float]] = {}
    for _ in range(args.prompts):
        for k, v in attempt(run, lambda: prompts.make(n)).items():
            samples.setdefault(k, []).append(round(v, 2))
    cell: dict[str, Any] = {"samples": samples, "cpu": window.close()}
    cell.update(_decode_delta(run, before, len(samples["ttft"])))
    return cell


def _first_then_fresh(ids: list[int], prompts: Prompts) -> Any:
    """ids for the first try; a retry gets a fresh prompt (a failed try may have cached ids)."""
    given = [False]

    def next_ids() -> list[int]:
        if given[0]:
            return prompts.make(len(ids))
        given[0] = True
        return ids

    return next_ids


def measure_interleaved(run: Running, n: int, args: argparse.Namespace, prompts: Prompts
                        ) -> dict[str, Any]:
    """--prompts rounds of one plain request and one through the pair (prefill, then decode), in
    ABBA order, both sides on the same n-token prompt. Also the CPU the idle side of the shared
    core burnt during each request (ms), which says whether it spun while the other ran."""
    before = _decode_snapshot(run)
    pg = run.pgids()
    idle_side = {"plain": pg["interleaved-prefill"], "pdxfer": pg["interleaved-plain"]}
    window = CpuWindow(pg)
    samples: dict[str, list[float]] = {}
    partner: dict[str, list[float]] = {"plain": [], "pdxfer": []}
    order = interleave_order("plain", "pdxfer", args.prompts)
    for i in range(0, len(order), 2):
        ids = prompts.make(n)
        for side in order[i:i + 2]:
            c0 = group_cpu_seconds(idle_side[side])
            got = attempt(run, _first_then_fresh(ids, prompts),
                          measure=run.extra["plain"] if side == "plain" else None)
            partner[side].append(round(1000 * (group_cpu_seconds(idle_side[side]) - c0), 1))
            for k, v in got.items():
                samples.setdefault("plain" if side == "plain" else k, []).append(round(v, 2))
            time.sleep(args.interleave_gap)
    cell: dict[str, Any] = {"samples": samples, "order": order, "cpu": window.close(),
                            "idle_partner_cpu_ms": partner}
    cell.update(_decode_delta(run, before, len(samples.get("ttft", []))))
    return cell


def measure_floor(run: Running, n: int, model: str, args: argparse.Namespace, prompts: Prompts
                  ) -> dict[str, Any]:
    """One decode step at length n on the configuration's plain instance: pairs of requests for
    the same prompt with max_tokens 1 and 1+k, ABBA, after a request that put the prompt's full
    blocks in the prefix cache; each pair's difference / k. Both requests of a pair do the same
    first step (the part of the prompt not cached, at least its last token), so the difference is
    the k steps that follow, at lengths n+1 .. n+k."""
    url, k = run.urls["plain"], args.floor_steps
    ids = prompts.make(n)
    completion_ms(url, model, ids, 1, args.request_timeout)
    completion_ms(url, model, ids, 1 + k, args.request_timeout)  # uncounted: first decode shapes
    lat: dict[str, list[float]] = {"one": [], "more": []}
    for side in interleave_order("one", "more", args.floor_reps):
        lat[side].append(round(completion_ms(url, model, ids, 1 if side == "one" else 1 + k,
                                             args.request_timeout), 2))
    return {"steps": k, "max_tokens_1_ms": lat["one"], "max_tokens_more_ms": lat["more"],
            "step_ms": step_differences(lat["one"], lat["more"], k)}


def measure_concurrency(run: Running, c: int, args: argparse.Namespace, prompts: Prompts
                        ) -> dict[str, Any]:
    """Batches of c requests at once (at least --prompts requests in all), each through prefill
    then decode; decode TTFT per request and the decode's per-load histogram over the level."""
    batches = max(1, math.ceil(args.prompts / c))
    before = _decode_snapshot(run)
    window = CpuWindow(run.pgids())
    samples: dict[str, list[float]] = {}
    for _ in range(batches):
        batch = [prompts.make(args.conc_tokens) for _ in range(c)]
        for s in concurrent_batch(run, batch, args.request_timeout):
            for k, v in s.items():
                samples.setdefault(k, []).append(round(v, 2))
    cell: dict[str, Any] = {"samples": samples, "batches": batches, "cpu": window.close()}
    cell.update(_decode_delta(run, before, len(samples.get("ttft", []))))
    return cell


def run_config(name: str, args: argparse.Namespace, model_dir: Path, model: str, log_dir: Path,
               prompts: Prompts, label: str | None = None) -> dict[str, Any]:
    """Start one configuration, warm it up, measure it, take its idle CPU, stop it."""
    cores = (args.prefill_cpus if name == "plain"
             else f"prefill and plain {args.prefill_cpus}, decode {args.decode_cpus}"
             if name == "interleaved" else f"prefill {args.prefill_cpus}, decode {args.decode_cpus}")
    print(f"\n== {label or name} (cores: {cores}; load avg {os.getloadavg()[0]:.2f}): starting", flush=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    vargs = ["--dtype", args.dtype, *args.vllm_arg]
    run = start_config(name, model_dir, model, log_dir, args.prefill_cpus, args.decode_cpus, vargs,
                       env, args.transport, args.request_timeout)
    try:
        took = run.stack.wait_ready(args.ready_timeout, _progress())
        print(f"  ready in {took:.0f} s", flush=True)
        # Warm-up, not counted: first requests pay one-off costs (NixlConnector's handshake,
        # allocator growth, first kernels for a shape).
        t0 = time.monotonic()
        for _ in range(args.warmup):
            for n in args.lengths:
                attempt(run, lambda n=n: prompts.make(n))
                for m in run.extra.values():
                    attempt(run, lambda n=n: prompts.make(n), measure=m)
        levels = args.concurrency if name in args.conc_configs else []
        if levels:
            concurrent_batch(run, [prompts.make(args.conc_tokens) for _ in range(max(levels))],
                             args.request_timeout)
        warm_errors = len(run.errors)
        print(f"  warm-up {time.monotonic() - t0:.0f} s", flush=True)
        out: dict[str, Any] = {"ready_s": round(took, 1), "cores": cores, "per_len": {},
                               "concurrency": {}}
        for n in args.lengths:
            measure = measure_interleaved if name == "interleaved" else measure_length
            cell = out["per_len"][str(n)] = measure(run, n, args, prompts)
            line = ", ".join(f"{k} {med(v)} (min {min(v):.1f})" for k, v in cell["samples"].items())
            if "load" in cell:
                line += (f"; loaded {cell['tokens_loaded_per_request']} tok/req "
                         f"({cell['bytes_loaded_per_request'] / 2**20:.2f} MiB), transfer mean "
                         f"{cell['load']['mean_ms']} ms")
            print(f"  {n:5d} tokens, median ms: {line}; foreign CPU {cell['cpu']['foreign_pct']}%",
                  flush=True)
        if "interleaved" == name:
            for n in args.lengths:
                p = out["per_len"][str(n)]["idle_partner_cpu_ms"]
                print(f"  {n:5d} tokens, CPU ms the idle instance on the shared core used during "
                      f"the other's request, median: during plain {med(p['plain'])}, during the "
                      f"pair {med(p['pdxfer'])}", flush=True)
        if "plain" in run.urls and args.floor:
            out["floor"] = {}
            for n in [1, *args.lengths]:
                f = out["floor"][str(n)] = measure_floor(run, n, model, args, prompts)
                print(f"  floor: one decode step at {n} tokens, median {med(f['step_ms'])} ms "
                      f"(max_tokens 1: {med(f['max_tokens_1_ms'])} ms)", flush=True)
        for c in levels:
            cell = out["concurrency"][str(c)] = measure_concurrency(run, c, args, prompts)
            s = cell["samples"].get("ttft", [])
            print(f"  concurrency {c:2d}: decode TTFT median {med(s)} ms over {len(s)} requests; "
                  f"transfer {cell.get('load')}; foreign CPU {cell['cpu']['foreign_pct']}%",
                  flush=True)
        time.sleep(args.settle)  # let the last requests' background work (frees, publishes) end
        out["idle"] = idle_cpu(run.pgids(), args.idle_seconds)
        print(f"  idle CPU over {args.idle_seconds:.0f} s (% of one core): "
              f"{out['idle']['pct_of_core']}; foreign {out['idle']['foreign_pct']}%", flush=True)
        out["errors"] = run.errors
        out["failed_requests"] = {"warmup": warm_errors, "measured": len(run.errors) - warm_errors}
        return out
    finally:
        run.stack.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="model directory (default: the project's tiny model, built if missing)")
    ap.add_argument("--dtype", default="float32",
                    help="--dtype for every instance (float32: the tiny random model in bf16 flips "
                         "greedy answers with batch composition)")
    ap.add_argument("--lengths", default="300,1000,1920,3000", help="prompt lengths in tokens")
    ap.add_argument("--prompts", type=int, default=8, help="fresh prompts per length and config")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted rounds over every length")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="run these, in this order")
    ap.add_argument("--no-bracket", dest="bracket", action="store_false",
                    help="measure the plain baseline only first (default: also after the pairs, "
                         "samples pooled, so drift of the machine's speed over a run cancels)")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip the decode's floor (one decode step + HTTP, on plain instances)")
    ap.add_argument("--floor-reps", type=int, default=None,
                    help="request pairs per length for the floor (default: --prompts)")
    ap.add_argument("--floor-steps", type=int, default=1,
                    help="k: the floor's step is (max_tokens 1+k minus max_tokens 1) / k")
    ap.add_argument("--interleave-gap", type=float, default=1.2,
                    help="pause (s) after each interleaved request: vLLM's workers busy-poll for "
                         "1 s after each step, and the idle instance must not spin on the shared "
                         "core during the other's request")
    ap.add_argument("--concurrency", default="1,4,16", help="concurrency levels ('' for none)")
    ap.add_argument("--conc-configs", default="pdxfer,nixl", help="pairs measured at concurrency")
    ap.add_argument("--conc-tokens", type=int, default=1000, help="prompt length under concurrency")
    ap.add_argument("--transport", choices=KINDS, default="tcp", help="pdxfer transport")
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=2.0, help="pause before the idle window")
    ap.add_argument("--prefill-cpus", default=None,
                    help="plain + prefill cores (default: first half of the allowed cores)")
    ap.add_argument("--decode-cpus", default=None, help="decode cores (default: the other half)")
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--ready-timeout", type=float, default=400)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                    help="extra `vllm serve` argument for every instance (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.conc_configs = [c.strip() for c in args.conc_configs.split(",") if c.strip()]
    args.floor_reps = args.prompts if args.floor_reps is None else args.floor_reps
    if args.floor_reps < 1 or args.floor_steps < 1 or args.prompts < 1:
        ap.error("--prompts, --floor-reps and --floor-steps must be at least 1")
    if args.interleave_gap < 0:
        ap.error("--interleave-gap must be >= 0")
    for c in args.configs + args.conc_configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r} ({', '.join(CONFIGS)})")
    split = split_cores()
    args.prefill_cpus = args.prefill_cpus or split[0]
    args.decode_cpus = args.decode_cpus or split[1]
    if set(args.prefill_cpus.split(",")) & set(args.decode_cpus.split(",")):
        print("warning: prefill and decode share cores; pair numbers will include interference",
              file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM takes the exception path, so every `finally` stops the configuration's processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    model_dir, mcfg, model = bench_model(args.model)
    longest = max(args.lengths + [args.conc_tokens])
    if longest + 2 + args.floor_steps > mcfg.get("max_position_embeddings", 1 << 30):
        sys.exit(f"bench/pd.py: {longest} tokens exceed the model's max_position_embeddings")
    log_dir = (args.log_dir or default_run_dir() / time.strftime("bench-pd-%Y%m%d-%H%M%S")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"{started} | model {model_dir} ({args.dtype}) | lengths {args.lengths} x {args.prompts} "
          f"prompts | concurrency {args.concurrency} at {args.conc_tokens} tokens | pdxfer "
          f"transport {args.transport} | load avg {os.getloadavg()} | logs {log_dir}", flush=True)

    t_start = time.monotonic()
    prompts = Prompts(args.seed, mcfg["vocab_size"])
    phases: dict[str, dict[str, Any]] = {}
    for name in args.configs:
        phases[name] = run_config(name, args, model_dir, model, log_dir, prompts)
    if args.bracket and "plain" in args.configs and len(args.configs) > 1:
        phases[PLAIN_AFTER] = run_config("plain", args, model_dir, model, log_dir, prompts, label=PLAIN_AFTER)

    rows = length_rows(phases, args.lengths)
    crows = concurrency_rows(phases, args.concurrency) if args.conc_configs else []
    idle = idle_summary(phases)
    tg = targets(rows, idle)
    print_summary(rows, crows, idle, tg, args.prompts)
    total = time.monotonic() - t_start
    print(f"total {total:.0f} s")
    if args.json:
        argv_used = sys.argv if argv is None else [sys.argv[0], *argv]
        result = {
            "command": " ".join(shlex.quote(a) for a in argv_used),
            "started_utc": started, "total_s": round(total, 1), "model": str(model_dir),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cpu_count": os.cpu_count(), "rows": rows, "concurrency": crows,
            "idle_cpu_pct_of_core": idle, "targets": tg, "phases": phases,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
