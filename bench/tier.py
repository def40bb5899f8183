#!/usr/bin/env python3
"""Host-tier benchmark: a working set of prefixes several times the KV cache, revisited with a
skewed (Zipf) popularity through a prefill/decode pair, with the host tier off and on.

  off   the pair as shipped (host_tier_mib 0): a chunk lives while its KV cache blocks are held
  on    the same pair with a host tier on each instance (--host-mib): chunks whose blocks are
        given back move to host memory and stay readable
  gated as 'on', with the reader's load-or-recompute rule (``load_benefit``): a decode loads only
        the prefix of a hit it expects to arrive sooner than it would compute it, from the loads
        and prefill steps it measured

Both configurations get the same trace (same seed), one configuration at a time, the proxy
routing from the master's index (a prompt the fleet holds skips the prefill). The KV cache is
made small on purpose (--gpu-blocks blocks per instance, vLLM's ``--num-gpu-blocks-override``)
so the working set is several times it, as on a GPU whose HBM holds a fraction of the prefixes
its users revisit.

The headline number does not depend on the machine: fleet-wide prompt tokens *computed* per
request (vLLM's ``prompt_tokens_by_source{source="local_compute"}`` summed over both instances,
prefill steps included); next to it tokens loaded, the share of them read from a host tier,
local prefix-cache hits, prefills skipped, chunks moved to host and evicted from it. TTFT (first
streamed token at the client) is reported too; both instances share two cores here, so it is
indicative only. The ratio printed is computed-per-request with the tier over without it. With
'gated' in the run it also prints what the rule is for: its TTFT p99 over the trace against the
p99 of 'off' (every hit the tier would add is recomputed there), and, request by request, how
many were slower than the same request in 'off' by more than the noise floor (``--slower-ms``).

    PYTHONPATH=. .venv/bin/python bench/tier.py --json bench/results/tier.json
    PYTHONPATH=. .venv/bin/python bench/tier.py --configs off,on,off,on   # run twice, bracketed
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fleet import add_model_args, add_run_args, counters, parse_configs, stream_completion  # noqa: E402
from bench.pd_util import bench_model, med  # noqa: E402
from pdxfer.common.procs import default_run_dir  # noqa: E402
from pdxfer.launch.fleet import read_prom_counter, start_pair  # noqa: E402

CONFIGS = ("off", "on", "gated")
PDXFER_COUNTERS = ("vllm:pdxfer_tokens_loaded_total", "vllm:pdxfer_host_tier_tokens_loaded_total",
                   "vllm:pdxfer_host_moves_total", "vllm:pdxfer_host_evictions_total",
                   "vllm:pdxfer_loads_failed_total", "vllm:pdxfer_load_benefit_declined_tokens_total")


def zipf_trace(n_prefixes: int, requests: int, s: float, seed: int) -> list[int]:
    """Which prefix each request revisits: rank r drawn with weight 1 / (r + 1) ** s, the ranks
    shuffled over the prefixes so the hot ones are not the first built."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** s for r in range(n_prefixes)]
    order = list(range(n_prefixes))
    rng.shuffle(order)
    return [order[i] for i in rng.choices(range(n_prefixes), weights, k=requests)]


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab - 1) for _ in range(n)]

    prefixes = [tokens(args.prefix_tokens) for _ in range(args.prefixes)]
    return [prefixes[p] + tokens(args.suffix_tokens)
            for p in zipf_trace(args.prefixes, args.requests, args.zipf, args.seed)]


def _pdxfer(url: str) -> dict[str, float]:
    return {name: read_prom_counter(url, name) for name in PDXFER_COUNTERS}


def _sum_delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url, a in after.items():
        for k, v in a.items():
            out[k] = out.get(k, 0.0) + v - before[url].get(k, 0.0)
    return out


def run_config(name: str, model_dir: Path, model: str, log_dir: Path, args: argparse.Namespace,
               prompts: list[list[int]], run: int) -> dict[str, Any]:
    tag = f"{name}-{run}"
    (log_dir / tag).mkdir(parents=True, exist_ok=True)
    print(f"\n== {tag}: starting (load avg {os.getloadavg()[0]:.2f})", flush=True)
    extra: dict[str, object] = {"retention_s": args.retention_s}
    if name in ("on", "gated"):
        extra["host_tier_mib"] = args.host_mib
    if name == "gated":
        extra["load_benefit"] = True
    vargs = ["--dtype", args.dtype, "--num-gpu-blocks-override", str(args.gpu_blocks),
             "--max-model-len", str(args.max_model_len)]
    stack, proxy = start_pair(model_dir, log_dir / tag, vllm_args=vargs, connector_extra=extra,
                              die_with_parent=True)
    try:
        took = stack.wait_ready(args.ready_timeout)
        print(f"  ready in {took:.0f} s", flush=True)
        instances = [u for u in (stack["prefill"].url, stack["decode"].url) if u]
        urls = instances + [proxy]
        before = {u: counters(u) for u in urls}
        before_px = {u: _pdxfer(u) for u in instances}
        ttfts: list[float] = []
        t0 = time.monotonic()
        for prompt in prompts:
            ttft, _ = stream_completion(proxy, model, prompt, args.answer_tokens, args.request_timeout)
            ttfts.append(round(ttft * 1e3, 2))
        wall = time.monotonic() - t0
        time.sleep(args.settle)  # late counter updates (vLLM's stats move with engine steps)
        d = _sum_delta({u: counters(u) for u in urls}, before)
        px = _sum_delta({u: _pdxfer(u) for u in instances}, before_px)
        n = len(prompts)
        loaded = px["vllm:pdxfer_tokens_loaded_total"]
        host = px["vllm:pdxfer_host_tier_tokens_loaded_total"]
        out = {
            "requests": n, "wall_s": round(wall, 1),
            "client_prompt_tokens_per_request": round(sum(map(len, prompts)) / n, 1),
            "computed_per_request": round(d.get("source:local_compute", 0.0) / n, 1),
            "loaded_per_request": round(d.get("source:external_kv_transfer", 0.0) / n, 1),
            "local_hits_per_request": round(d.get("source:local_cache_hit", 0.0) / n, 1),
            "host_tier_share_of_loaded": round(host / loaded, 3) if loaded else 0.0,
            "prefills_skipped": int(d.get("route:decode-only", 0.0)),
            "host_moves": int(px["vllm:pdxfer_host_moves_total"]),
            "host_evictions": int(px["vllm:pdxfer_host_evictions_total"]),
            "loads_failed": int(px["vllm:pdxfer_loads_failed_total"]),
            "tokens_declined_per_request": round(px["vllm:pdxfer_load_benefit_declined_tokens_total"] / n, 1),
            "ttft_ms": {"p50": med(ttfts), "p99": round(sorted(ttfts)[min(n - 1, int(0.99 * n))], 2),
                        "samples": ttfts},
        }
        print(f"  {n} requests in {wall:.0f} s: computed {out['computed_per_request']} tok/req of "
              f"{out['client_prompt_tokens_per_request']}, loaded {out['loaded_per_request']} "
              f"({out['host_tier_share_of_loaded']:.0%} from a host tier), local hits "
              f"{out['local_hits_per_request']}, prefills skipped {out['prefills_skipped']}, host moves "
              f"{out['host_moves']}, host evictions {out['host_evictions']}, failed loads "
              f"{out['loads_failed']}, TTFT p50 {out['ttft_ms']['p50']} ms p99 {out['ttft_ms']['p99']} ms",
              flush=True)
        return out
    finally:
        stack.stop()


def gate_check(runs: dict[str, list[dict[str, Any]]], slower_ms: float) -> dict[str, Any] | None:
    """With 'gated' and 'off' in the run: the rule's TTFT p99 over the trace against recomputing
    (medians over repeated runs), and requests slower than the same request recomputed; None otherwise."""
    if not runs.get("gated") or not runs.get("off"):
        return None
    gated_p99 = med([r["ttft_ms"]["p99"] for r in runs["gated"]])
    off_p99 = med([r["ttft_ms"]["p99"] for r in runs["off"]])
    # Request i of the trace in each configuration: the median of its TTFTs over repeated runs.
    per = {name: [med(list(xs)) for xs in zip(*(r["ttft_ms"]["samples"] for r in runs[name]))]
           for name in ("gated", "off")}
    slower = sum(1 for g, o in zip(per["gated"], per["off"]) if g > o + slower_ms)
    return {"gated_ttft_p99_ms": gated_p99, "off_ttft_p99_ms": off_p99,
            "p99_ratio": round(gated_p99 / off_p99, 3) if off_p99 else None,
            "slower_requests": slower, "requests": len(per["off"]), "slower_ms": slower_ms}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, CONFIGS, "run these, in this order (repeats allowed)")
    ap.add_argument("--prefixes", type=int, default=16, help="distinct prefixes in the working set")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64, help="each request's own tokens after its prefix")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity skew (weight of rank r: 1/(r+1)^s)")
    ap.add_argument("--answer-tokens", type=int, default=4)
    ap.add_argument("--gpu-blocks", type=int, default=48, help="KV cache blocks per instance")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--host-mib", type=int, default=128, help="host tier per instance (configs 'on', 'gated')")
    ap.add_argument("--slower-ms", type=float, default=50.0,
                    help="with 'gated': a request counts as slower than in 'off' only past this many ms")
    ap.add_argument("--retention-s", type=float, default=60.0)
    add_run_args(ap)
    args = ap.parse_args(argv)
    args.configs = parse_configs(ap, args.configs, CONFIGS)
    if min(args.prefixes, args.prefix_tokens, args.suffix_tokens, args.requests, args.gpu_blocks,
           args.host_mib, args.answer_tokens) < 1:
        ap.error("--prefixes, --prefix-tokens, --suffix-tokens, --requests, --gpu-blocks, --host-mib "
                 "and --answer-tokens must be at least 1")
    if args.prefix_tokens + args.suffix_tokens + args.answer_tokens > args.max_model_len:
        ap.error("a prompt and its answer must fit --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    model_dir, mcfg, model = bench_model(args.model)
    log_dir = (args.log_dir or default_run_dir() / time.strftime("bench-tier-%Y%m%d-%H%M%S")).resolve()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    prompts = make_prompts(args, mcfg["vocab_size"])
    print(f"{started} | {args.prefixes} prefixes of {args.prefix_tokens} tokens (working set "
          f"{args.prefixes * args.prefix_tokens} tokens), {args.requests} requests, Zipf s={args.zipf}, "
          f"{args.gpu_blocks} KV blocks per instance | logs {log_dir}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in args.configs:
        runs.setdefault(name, []).append(run_config(name, model_dir, model, log_dir, args, prompts,
                                                    len(runs.get(name, []))))
    summary = {name: {"computed_per_request": med([r["computed_per_request"] for r in rs]),
                      "ttft_p50_ms": med([r["ttft_ms"]["p50"] for r in rs]),
                      "ttft_p99_ms": med([r["ttft_ms"]["p99"] for r in rs])} for name, rs in runs.items()}
    ratio = None
    if "on" in summary and "off" in summary and summary["off"]["computed_per_request"]:
        ratio = round(summary["on"]["computed_per_request"] / summary["off"]["computed_per_request"], 3)
    print("\nfleet-wide prompt tokens computed per request (median of runs):")
    for name, s in summary.items():
        print(f"  {name:4s} {s['computed_per_request']:8.1f}  TTFT p50 {s['ttft_p50_ms']} ms p99 {s['ttft_p99_ms']} ms")
    if ratio is not None:
        print(f"  tier on / off: {ratio}x")
    gate = gate_check(runs, args.slower_ms)
    if gate is not None:
        print(f"  gated TTFT p99 {gate['gated_ttft_p99_ms']} ms vs off {gate['off_ttft_p99_ms']} ms "
              f"({gate['p99_ratio']}x; target <= 1); requests slower than in 'off' by more than "
              f"{args.slower_ms:g} ms: {gate['slower_requests']} of {gate['requests']}", flush=True)
    if args.json:
        argv_used = sys.argv if argv is None else [sys.argv[0], *argv]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "tier", "command": " ".join(shlex.quote(a) for a in argv_used), "started_utc": started,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg(), "runs": runs,
            "summary": summary, "computed_ratio_on_to_off": ratio, "gate_check": gate,
            "target": "with the tier, prompt tokens computed per request at most 0.5x without it",
        }, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
