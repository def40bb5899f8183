#!/usr/bin/env python3
"""Fleet benchmark: multi-turn conversations against a 2x2 fleet, one configuration at a time.

  routed   pdxfer: 2 prefill + 2 decode instances, the proxy routing from the master's index
           (prefill skipped when the fleet holds the prompt, requests sent to the holders)
  rr       pdxfer: the same fleet, the proxy round-robin (no index)
  nixl     vLLM's NixlConnector: 2 prefill + 2 decode instances behind the same proxy,
           round-robin, block ids handed over (the baseline)

The workload: shared system prompts, users arriving a few per round, each turn's prompt the
conversation so far (system prompt, every earlier message and answer) plus a new message. Every
configuration gets the same conversations (same seeds); answers are greedy.

The headline number does not depend on the machine: fleet-wide prompt tokens *computed* per
request (vLLM's ``prompt_tokens_by_source{source="local_compute"}`` summed over every instance,
prefill steps included), next to tokens loaded from other instances, local prefix-cache hits,
prefills skipped and re-pulls. TTFT (first streamed token at the client, through the proxy) is
reported too, but four instances share two cores here, so it is indicative only.

    PYTHONPATH=. .venv/bin/python bench/fleet.py --json bench/results/fleet.json
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
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.pd_util import bench_model, med  # noqa: E402
from pdxfer.common.procs import default_run_dir, free_port  # noqa: E402
from pdxfer.launch.fleet import Component, Stack, start_fleet, start_proxy  # noqa: E402
from pdxfer.launch.plan import split_cores_among  # noqa: E402

CONFIGS = ("routed", "rr", "nixl")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Fleet:
    name: str
    stack: Stack
    proxy_url: str
    instances: list[str]  # every vLLM instance's base URL
    decodes: list[str]


@dataclass
class Conversation:
    system: list[int]
    messages: list[list[int]]
    answers: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        out = list(self.system)
        for i in range(turn):
            out += self.messages[i] + self.answers[i]
        return out + self.messages[turn]


def make_conversations(args: argparse.Namespace, vocab: int) -> list[Conversation]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab - 1) for _ in range(n)]

    systems = [tokens(args.system_tokens) for _ in range(args.system_prompts)]
    lo, hi = args.message_tokens
    return [Conversation(systems[u % len(systems)], [tokens(rng.randint(lo, hi)) for _ in range(args.turns)])
            for u in range(args.users)]


def schedule(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(user, turn) in the order sent: each round every active user takes a turn, and
    ``--arrivals`` new users join per round (so histories of different lengths interleave).

    ``--order shuffled`` (the default) sends each round's turns in a seeded random order, as
    users who answer at their own pace do. ``lockstep`` keeps user order in every round: with
    an even number of turns per round, a round-robin proxy then sends every turn of a user to
    the same instance, a stickiness real traffic does not have."""
    rng = random.Random(args.seed + 1)
    out = []
    r = 0
    while True:
        this_round = [(u, r - u // args.arrivals) for u in range(args.users)
                      if 0 <= r - u // args.arrivals < args.turns]
        if not this_round and r > args.users // args.arrivals + args.turns:
            return out
        if args.order == "shuffled":
            rng.shuffle(this_round)
        out += this_round
        r += 1


def counters(base_url: str) -> dict[str, float]:
    """The vLLM (or proxy) counters this benchmark reads, summed over engines; prompt tokens by
    source keyed ``source:<name>``, proxy routes keyed ``route:<decision>``."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                k = "source:" + s.labels.get("source", "")
            elif s.name == "pdxfer_proxy_routes_total":
                k = "route:" + s.labels.get("decision", "")
            elif s.name in ("vllm:pdxfer_repulls_total", "vllm:prompt_tokens_total"):
                k = s.name
            else:
                continue
            out[k] = out.get(k, 0.0) + s.value
    return out


def fleet_counters(fleet: Fleet) -> dict[str, dict[str, float]]:
    """Every instance's counters (and the proxy's), by base URL."""
    return {url: counters(url) for url in fleet.instances + [fleet.proxy_url]}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


def stream_completion(proxy_url: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float) -> tuple[float, list[int]]:
    """A greedy streamed completion through the proxy: (seconds to the first token, answer ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(proxy_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            toks = (choice.get("logprobs") or {}).get("tokens") or []
            if toks and ttft is None:
                ttft = time.perf_counter() - t0
            ids += [int(t.split(":", 1)[1]) for t in toks]
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return ttft, ids


def start(name: str, model_dir: Path, log_dir: Path, args: argparse.Namespace) -> Fleet:
    vargs = ["--dtype", args.dtype]
    if args.block_size:
        vargs += ["--block-size", str(args.block_size)]
    if args.gpu_blocks:
        vargs += ["--num-gpu-blocks-override", str(args.gpu_blocks), "--max-model-len", str(args.max_model_len)]
    if name in ("routed", "rr"):
        proxy_args = ["--policy", "round_robin"]
        extra = {"host_tier_mib": args.host_mib} if args.host_mib else None
        stack, proxy = start_fleet(model_dir, log_dir / name, n_prefill=2, n_decode=2,
                                   chunk_tokens=args.chunk_tokens, kv_cache_gib=args.kv_cache_gib, vllm_args=vargs,
                                   connector_extra=extra, index_routing=(name == "routed"),
                                   proxy_args=proxy_args, die_with_parent=True)
        inst = [c.url for c in stack.components if c.name.startswith(("prefill", "decode"))]
        dec = [c.url for c in stack.components if c.name.startswith("decode")]
        return Fleet(name, stack, proxy, inst, dec)
    cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
           "kv_connector_extra_config": {"num_threads": 1}}
    stack = Stack()
    try:
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        cores = split_cores_among(4)
        for i, (role, cpu) in enumerate(zip(("prefill", "prefill", "decode", "decode"), cores)):
            env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
            urls[role].append(stack.add_vllm(f"nixl-{role}-{i % 2}", model_dir, log_dir / name, cfg, cpu,
                                             vargs, env, die_with_parent=True))
        proc, proxy = start_proxy(urls["prefill"], urls["decode"], log_dir / name,
                                  extra_args=["--handoff", "nixl", "--policy", "round_robin"],
                                  die_with_parent=True)
        stack.add(Component("proxy", proc, proxy + "/health", url=proxy))
    except BaseException:
        stack.stop(5)
        raise
    return Fleet(name, stack, proxy, urls["prefill"] + urls["decode"], urls["decode"])


def run_config(name: str, model_dir: Path, model: str, log_dir: Path, args: argparse.Namespace,
               vocab: int) -> dict[str, Any]:
    (log_dir / name).mkdir(parents=True, exist_ok=True)
    print(f"\n== {name}: starting (load avg {os.getloadavg()[0]:.2f})", flush=True)
    fleet = start(name, model_dir, log_dir, args)
    try:
        took = fleet.stack.wait_ready(args.ready_timeout)
        print(f"  ready in {took:.0f} s", flush=True)
        convs = make_conversations(args, vocab)
        before = fleet_counters(fleet)
        ttfts: list[float] = []
        prompt_tokens = 0
        order = schedule(args)
        t0 = time.monotonic()
        for u, t in order:
            prompt = convs[u].prompt(t)
            prompt_tokens += len(prompt)
            ttft, answer = stream_completion(fleet.proxy_url, model, prompt, args.answer_tokens,
                                             args.request_timeout)
            convs[u].answers.append(answer)
            ttfts.append(round(ttft * 1e3, 2))
        wall = time.monotonic() - t0
        time.sleep(args.settle)  # late counter updates (vLLM logs stats per step)
        after = fleet_counters(fleet)
        per_instance = {url: _delta(after[url], before[url]) for url in after}
        d: dict[str, float] = {}
        for dd in per_instance.values():
            for k, v in dd.items():
                d[k] = d.get(k, 0.0) + v
        n = len(order)
        out = {
            "requests": n, "wall_s": round(wall, 1),
            "client_prompt_tokens_per_request": round(prompt_tokens / n, 1),
            "computed_per_request": round(d.get("source:local_compute", 0.0) / n, 1),
            "loaded_per_request": round(d.get("source:external_kv_transfer", 0.0) / n, 1),
            "local_hits_per_request": round(d.get("source:local_cache_hit", 0.0) / n, 1),
            "prefills_skipped": int(d.get("route:decode-only", 0.0)),
            "routes": {k[6:]: int(v) for k, v in d.items() if k.startswith("route:") and v},
            "repulls": int(d.get("vllm:pdxfer_repulls_total", 0.0)),
            "ttft_ms": {"p50": med(ttfts), "p99": round(sorted(ttfts)[min(n - 1, int(0.99 * n))], 2),
                        "samples": ttfts},
            "per_instance": {url: {k: v for k, v in dd.items() if v} for url, dd in per_instance.items()},
        }
        print(f"  {n} requests in {wall:.0f} s: computed {out['computed_per_request']} tok/req of "
              f"{out['client_prompt_tokens_per_request']}, loaded {out['loaded_per_request']}, local hits "
              f"{out['local_hits_per_request']}, prefills skipped {out['prefills_skipped']}, re-pulls "
              f"{out['repulls']}, TTFT p50 {out['ttft_ms']['p50']} ms p99 {out['ttft_ms']['p99']} ms",
              flush=True)
        return out
    finally:
        fleet.stack.stop()


def add_model_args(ap: argparse.ArgumentParser, configs: tuple[str, ...], help_configs: str) -> None:
    """The model, its dtype and the configurations to run (bench/fleet.py, bench/tier.py)."""
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--configs", default=",".join(configs), help=help_configs)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """Bounds, seed and outputs of a run (bench/fleet.py, bench/tier.py)."""
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)


def parse_configs(ap: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> list[str]:
    """``--configs`` as a list, every name checked against ``known``."""
    out = [c.strip() for c in text.split(",") if c.strip()]
    for c in out:
        if c not in known:
            ap.error(f"unknown config {c!r} ({', '.join(known)})")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, CONFIGS, "run these, in this order")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=2, help="new users per round")
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--message-tokens", default="60,180", help="range of a user message's length")
    ap.add_argument("--answer-tokens", type=int, default=24, help="max_tokens of each answer")
    ap.add_argument("--order", choices=("shuffled", "lockstep"), default="shuffled",
                    help="each round's turns in a seeded random order, or in user order")
    ap.add_argument("--block-size", type=int, default=0,
                    help="every instance's KV block size in tokens, all configurations alike (0: vLLM's "
                         "default, 128 on CPU, whose attention takes multiples of 32; GPUs default to 16)")
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--gpu-blocks", type=int, default=0,
                    help="KV cache blocks per instance (0: what --kv-cache-gib holds)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="with --gpu-blocks")
    ap.add_argument("--host-mib", type=int, default=0, help="host tier per pdxfer instance (0: off)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="pdxfer's chunk size (default: the master's)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    args.configs = parse_configs(ap, args.configs, CONFIGS)
    lo, _, hi = args.message_tokens.partition(",")
    args.message_tokens = (int(lo), int(hi or lo))
    if not 0 < args.message_tokens[0] <= args.message_tokens[1]:
        ap.error(f"--message-tokens must be 'LO,HI' with 0 < LO <= HI, got {args.message_tokens}")
    if min(args.users, args.turns, args.arrivals, args.system_prompts) < 1:
        ap.error("--users, --turns, --arrivals and --system-prompts must be at least 1")
    if args.block_size < 0:
        ap.error(f"--block-size must be positive (or 0: vLLM's default), got {args.block_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    model_dir, mcfg, model = bench_model(args.model)
    longest = args.system_tokens + args.turns * (args.message_tokens[1] + args.answer_tokens)
    if longest + 2 > mcfg.get("max_position_embeddings", 1 << 30):
        sys.exit(f"bench/fleet.py: conversations reach {longest} tokens, over the model's max_position_embeddings")
    log_dir = (args.log_dir or default_run_dir() / time.strftime("bench-fleet-%Y%m%d-%H%M%S")).resolve()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"{started} | {args.users} users x {args.turns} turns, {args.system_prompts} system prompts of "
          f"{args.system_tokens} tokens | logs {log_dir}", flush=True)
    results = {name: run_config(name, model_dir, model, log_dir, args, mcfg["vocab_size"]) for name in args.configs}
    print("\nfleet-wide prompt tokens computed per request:")
    base = results.get("nixl", {}).get("computed_per_request")
    ratios = {}
    for name, r in results.items():
        ratio = round(r["computed_per_request"] / base, 3) if base else None
        ratios[name] = ratio
        print(f"  {name:7s} {r['computed_per_request']:8.1f}" + (f"  ({ratio}x NixlConnector round-robin)" if ratio else ""))
    if args.json:
        argv_used = sys.argv if argv is None else [sys.argv[0], *argv]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": " ".join(shlex.quote(a) for a in argv_used), "started_utc": started,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cpu_count": os.cpu_count(), "results": results, "computed_ratio_to_nixl": ratios,
            "target": "routed computes at most 0.5x NixlConnector round-robin per request",
        }, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
