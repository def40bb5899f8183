"""Helpers for bench/pd.py: HTTP requests, Prometheus scrapes, CPU accounting, prompts, statistics.

Nothing here starts processes; bench/pd_configs.py does that. Kept apart so that bench/pd.py reads
as the measurement procedure.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[float, dict]:
    """POST and return (elapsed ms, parsed answer); HTTP errors raise RuntimeError with the body.

    The timeout bounds every request, so a stuck instance turns into a failed sample, not a hang.
    """
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    return (time.perf_counter() - t0) * 1000.0, out


# ------------------------------------------------------------------------------------------------
# Prometheus
# ------------------------------------------------------------------------------------------------


def scrape(base_url: str, timeout: float = 5) -> dict[str, float]:
    """One /metrics scrape: metric name -> value summed over label sets, except histogram buckets,
    which are keyed `name_bucket@LE` (summed over the other labels) so deltas give a distribution."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name.endswith("_bucket"):
            le = labels.split('le="', 1)[1].split('"', 1)[0] if 'le="' in labels else "+Inf"
            name = f"{name}@{le}"
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def hist_delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> dict[str, Any]:
    """A histogram's change between two scrapes: count, mean (ms) and the bucket bound (ms) under
    which half (p50) and nine in ten (p90) of the new observations fall."""
    count = delta(after, before, name + "_count")
    total = delta(after, before, name + "_sum")
    buckets = sorted(((float(k.split("@", 1)[1]), delta(after, before, k)) for k in after
                      if k.startswith(name + "_bucket@")), key=lambda b: b[0])

    def bound(q: float) -> float | str | None:
        finite = [le for le, _ in buckets if le != float("inf")]
        for le, cum in buckets:
            if count and cum >= q * count:
                # Past the last finite bucket: say so rather than print infinity (not JSON).
                return round(le * 1000, 1) if le != float("inf") else f">{finite[-1] * 1000:g}"
        return None

    return {"count": int(count), "mean_ms": round(1000 * total / count, 2) if count else None,
            "p50_le_ms": bound(0.5), "p90_le_ms": bound(0.9)}


def settle(base_url: str, name: str, target: float, timeout: float = 3.0) -> dict[str, float]:
    """Scrape until counter `name` reaches `target` or `timeout` passes; the last scrape.

    vLLM hands connector stats to its API process with the step's outputs, which can land just
    after the HTTP answer; waiting (bounded) keeps a late observation out of the next cell."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(base_url)
        if got.get(name, 0.0) >= target or time.monotonic() >= deadline:
            return got
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------
# CPU accounting
# ------------------------------------------------------------------------------------------------


def group_cpu_seconds(pgid: int) -> float:
    """utime+stime of every live process in a process group (vLLM's API server + engine core +
    anything they spawned); a vLLM instance is more than one process."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (parts + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


class CpuWindow:
    """CPU used during a window by our process groups, and by everything else on the machine
    ("foreign": other people's jobs; on a shared box this says whether a cell can be trusted)."""

    def __init__(self, pgids: Mapping[str, int]) -> None:
        self.pgids = dict(pgids)
        self.t0 = time.monotonic()
        self.busy0 = machine_busy_seconds()
        self.self0 = sum(os.times()[:2])
        self.ours0 = {k: group_cpu_seconds(g) for k, g in self.pgids.items()}

    def close(self) -> dict[str, Any]:
        """% of one core per group, and foreign % of one core, over the window."""
        wall = max(1e-6, time.monotonic() - self.t0)
        ours = {k: group_cpu_seconds(g) - self.ours0[k] for k, g in self.pgids.items()}
        mine = sum(os.times()[:2]) - self.self0
        foreign = machine_busy_seconds() - self.busy0 - sum(ours.values()) - mine
        return {"seconds": round(wall, 1),
                "pct_of_core": {k: round(100 * v / wall, 1) for k, v in ours.items()},
                "bench_client_pct": round(100 * mine / wall, 1),
                "foreign_pct": round(max(0.0, 100 * foreign / wall), 1),
                "load_avg_1m": round(os.getloadavg()[0], 2)}


def idle_cpu(pgids: Mapping[str, int], seconds: float) -> dict[str, Any]:
    """% of one core each process group used over `seconds` with no traffic (one shared window)."""
    w = CpuWindow(pgids)
    time.sleep(seconds)
    return w.close()


# ------------------------------------------------------------------------------------------------
# prompts and statistics
# ------------------------------------------------------------------------------------------------


class Prompts:
    """Random token-id prompts; every call gives ids never sent before (seeded, reproducible), so
    no prefix cache, local or remote, can help a measured request."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def make(self, n: int) -> list[int]:
        # Skip the low ids (special tokens of the tiny tokenizer).
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]


def med(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return round(statistics.median(xs), 2) if xs else None


def low(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return round(min(xs), 2) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ------------------------------------------------------------------------------------------------
# the decode's floor and interleaved A/B
# ------------------------------------------------------------------------------------------------


def interleave_order(a: str, b: str, pairs: int) -> list[str]:
    """`pairs` rounds of one request to each of a and b, in ABBA order (a b, b a, a b, ...).

    Plain alternation would always run one side right after the other; ABBA gives each side the
    same number of turns first and second, so what one request leaves behind (a background
    publish, a warm cache) and any linear drift of the machine's speed weigh on both alike."""
    if pairs < 0:
        raise ValueError(f"pairs must be >= 0, got {pairs}")
    if a == b:
        raise ValueError(f"interleaving needs two different sides, got {a!r} twice")
    out: list[str] = []
    for i in range(pairs):
        out += [a, b] if i % 2 == 0 else [b, a]
    return out


def step_differences(one: list[float], more: list[float], steps: int) -> list[float]:
    """Per repetition, (latency of max_tokens 1+steps) - (latency of max_tokens 1), over steps:
    the cost of one decode step. Paired so that the first step's own noise (it recomputes the
    partial last block even on a prefix-cache hit) cancels within each pair."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if len(one) != len(more):
        raise ValueError(f"unpaired samples: {len(one)} with max_tokens 1, {len(more)} with more")
    return [round((m - o) / steps, 3) for o, m in zip(one, more)]


def floor_ms(step_n: float | None, one_token_ttft: float | None, step_1: float | None) -> float | None:
    """The least a decode's TTFT at length n can be: the HTTP/scheduling cost of a request
    (a one-token prompt's TTFT minus the engine step inside it) plus one step at length n."""
    if step_n is None or one_token_ttft is None or step_1 is None:
        return None
    return round(step_n + one_token_ttft - step_1, 2)


def bench_model(model: Path | None) -> tuple[Path, dict[str, Any], str]:
    """The model directory (default: the project's tiny model, built if missing), its
    config.json and the name its instances serve it under."""
    from pdxfer.launch.serve_shim import served_model_name
    from pdxfer.launch.tiny_model import default_tiny_model_dir, make_tiny_model

    model_dir = (model or make_tiny_model(default_tiny_model_dir())).resolve()
    return model_dir, json.loads((model_dir / "config.json").read_text()), served_model_name(model_dir)
