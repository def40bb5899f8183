"""The three configurations bench/pd.py measures, and one request through each.

  plain   one `vllm serve`, no connector: the recompute baseline (prefill core).
  pdxfer  pdxfer-master + prefill (kv_producer, prefill core) + decode (kv_consumer, decode core).
  nixl    vLLM's NixlConnector pair on the same cores: P/D pull, kv_buffer_device cpu, num_threads 1,
          distinct side-channel ports; the prefill answer's kv_transfer_params go to the decode.
  interleaved  the pdxfer pair plus a plain instance on the prefill's cores; requests alternate
          between plain and the pair, so the prefill is compared with plain under the same drift.

Every instance gets the same model, dtype and extra `vllm serve` flags, so the pairs differ from
the baseline only by their connector. TTFT is the latency of a `max_tokens: 1` request, the same
measure everywhere. Every process of an instance (API server, engine core, workers) is confined to
its cores (`taskset`), not just its OpenMP threads: vLLM's engine and workers busy-wait for a
second after each step, and a decode's spin on the prefill's core slowed the next prefill by up
to 14% (3000 tokens) in the first bench-model run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.pd_util import post_json
from pdxfer.contracts.prefill_step import prefill_step_params
from pdxfer.common.procs import free_port
from pdxfer.launch.fleet import Stack
from pdxfer.launch.plan import pdxfer_kv_config

CONFIGS = ("plain", "pdxfer", "nixl", "interleaved")

# Decode-side Prometheus names per pair: (per-load transfer histogram, tokens-loaded counter).
PDXFER_HIST = "vllm:pdxfer_load_seconds"
NIXL_HIST = "vllm:nixl_xfer_time_seconds"
PDXFER_TOKENS = "vllm:pdxfer_tokens_loaded_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # vLLM's own count, any connector
DECODE_METRICS = {"pdxfer": (PDXFER_HIST, PDXFER_TOKENS), "nixl": (NIXL_HIST, EXTERNAL_HITS),
                  "interleaved": (PDXFER_HIST, PDXFER_TOKENS)}
# KV bytes a decode read, per pair (NixlConnector's per-transfer histogram sums them).
DECODE_BYTES = {"pdxfer": "vllm:pdxfer_bytes_loaded_total", "interleaved": "vllm:pdxfer_bytes_loaded_total",
                "nixl": "vllm:nixl_bytes_transferred_sum"}

NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}

Measure = Callable[[list[int]], dict[str, float]]


@dataclass
class Running:
    """A started configuration: its processes, role -> base URL, and one-request measure."""

    name: str
    stack: Stack
    urls: dict[str, str]
    measure: Measure
    errors: list[str] = field(default_factory=list)
    # Further one-request measures run beside `measure` (interleaved: "plain").
    extra: dict[str, Measure] = field(default_factory=dict)

    def pgids(self) -> dict[str, int]:
        # Each component runs in its own process group (pdxfer.common.procs), led by its pid.
        return {c.name: c.proc.pid for c in self.stack.components}


def _body(model: str, ids: list[int], extra: dict | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    body.update(extra or {})
    return body


def _measure_for(name: str, urls: dict[str, str], model: str, timeout: float) -> Measure:
    def plain(ids: list[int]) -> dict[str, float]:
        ms, _ = post_json(urls["plain"] + "/v1/completions", _body(model, ids), timeout)
        return {"ttft": ms}

    def pdxfer(ids: list[int]) -> dict[str, float]:
        # Like the proxy: the prefill instance computes and publishes (its step marked as the
        # proxy marks it: a recurrent hybrid then stops one token short), then the decode instance
        # gets the same prompt and finds the chunks through the master (no block ids handed
        # over); the prefill's kv_transfer_params (its publish hint) go along, as any P/D proxy
        # forwards them, so the decode waits for a publish still on its way.
        p_ms, out = post_json(urls["prefill"] + "/v1/completions",
                              _body(model, ids, {"kv_transfer_params": prefill_step_params()}), timeout)
        hint = out.get("kv_transfer_params")
        extra = {"kv_transfer_params": hint} if hint else None
        d_ms, _ = post_json(urls["decode"] + "/v1/completions", _body(model, ids, extra), timeout)
        return {"prefill": p_ms, "ttft": d_ms}

    def nixl(ids: list[int]) -> dict[str, float]:
        p_ms, out = post_json(urls["prefill"] + "/v1/completions",
                              _body(model, ids, {"kv_transfer_params": NIXL_PREFILL_PARAMS}), timeout)
        params = out.get("kv_transfer_params")
        if not params:
            raise RuntimeError("NixlConnector prefill returned no kv_transfer_params")
        d_ms, _ = post_json(urls["decode"] + "/v1/completions",
                            _body(model, ids, {"kv_transfer_params": params}), timeout)
        return {"prefill": p_ms, "ttft": d_ms}

    return {"plain": plain, "pdxfer": pdxfer, "nixl": nixl, "interleaved": pdxfer}[name]


def completion_ms(url: str, model: str, ids: list[int], max_tokens: int, timeout: float) -> float:
    """Latency of one request that must generate exactly `max_tokens` tokens (ignore_eos: a
    random model may sample EOS first, and a request ending early would count no decode step)."""
    ms, out = post_json(url + "/v1/completions",
                        _body(model, ids, {"max_tokens": max_tokens, "ignore_eos": True}), timeout)
    got = (out.get("usage") or {}).get("completion_tokens")
    if got != max_tokens:
        raise RuntimeError(f"{url}: asked for {max_tokens} tokens, got {got}")
    return ms


def start_config(name: str, model_dir: Path, model: str, log_dir: Path, prefill_cpus: str,
                 decode_cpus: str, vllm_args: list[str], env: dict[str, str], transport: str,
                 request_timeout: float) -> Running:
    """Start one configuration's processes (no waiting); on any error everything is stopped.
    Call from the main thread: the children also get SIGTERM if this process dies."""
    stack = Stack()
    urls: dict[str, str] = {}
    try:
        if name == "plain":
            # The baseline runs on the prefill core, alone: nothing else is measured meanwhile.
            urls["plain"] = stack.add_vllm("plain", model_dir, log_dir, None, prefill_cpus,
                                           vllm_args, env, die_with_parent=True, pin_process=True)
        elif name == "pdxfer":
            master = stack.add_master(log_dir, die_with_parent=True)
            for role, kv_role, cpus in (("prefill", "kv_producer", prefill_cpus),
                                        ("decode", "kv_consumer", decode_cpus)):
                urls[role] = stack.add_vllm(f"pdxfer-{role}", model_dir, log_dir,
                                            pdxfer_kv_config(kv_role, master, transport), cpus,
                                            vllm_args, env, die_with_parent=True, pin_process=True)
        elif name == "interleaved":
            # Plain shares the prefill's cores; the two are never sent requests at once.
            master = stack.add_master(log_dir, die_with_parent=True)
            for role, kv_role, cpus in (("prefill", "kv_producer", prefill_cpus),
                                        ("decode", "kv_consumer", decode_cpus)):
                urls[role] = stack.add_vllm(f"interleaved-{role}", model_dir, log_dir,
                                            pdxfer_kv_config(kv_role, master, transport), cpus,
                                            vllm_args, env, die_with_parent=True, pin_process=True)
            urls["plain"] = stack.add_vllm("interleaved-plain", model_dir, log_dir, None,
                                           prefill_cpus, vllm_args, env, die_with_parent=True,
                                           pin_process=True)
        elif name == "nixl":
            cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                   "kv_buffer_device": "cpu", "kv_connector_extra_config": {"num_threads": 1}}
            for role, cpus in (("prefill", prefill_cpus), ("decode", decode_cpus)):
                # Two NixlConnector instances on one host need distinct side-channel ports.
                role_env = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
                urls[role] = stack.add_vllm(f"nixl-{role}", model_dir, log_dir, cfg, cpus,
                                            vllm_args, role_env, die_with_parent=True, pin_process=True)
        else:
            raise ValueError(f"unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
    except BaseException:
        stack.stop(5)
        raise
    run = Running(name, stack, urls, _measure_for(name, urls, model, request_timeout))
    if name == "interleaved":
        run.extra["plain"] = _measure_for("plain", urls, model, request_timeout)
    return run


def attempt(run: Running, ids_for: Callable[[], list[int]], tries: int = 3,
            measure: Measure | None = None) -> dict[str, float]:
    """One measurement (run.measure, or `measure`) on a fresh prompt. A failure (e.g.
    NixlConnector's 5 s handshake timing out) is logged in run.errors and retried on a new prompt,
    at most `tries` times."""
    for i in range(tries):
        try:
            return (measure or run.measure)(ids_for())
        except (RuntimeError, OSError) as e:
            run.errors.append(str(e)[:300])
            print(f"  {run.name}: request failed (try {i + 1}/{tries}): {str(e)[:200]}", flush=True)
            time.sleep(1)
    raise RuntimeError(f"{run.name}: {tries} failures in a row; see {run.stack.components[0].proc.log_path.parent}")


def concurrent_batch(run: Running, prompts: list[list[int]], timeout: float) -> list[dict[str, float]]:
    """Send every prompt at once (one thread each, released together by a barrier), each through
    the configuration's full path (prefill then decode, as the proxy does); the samples that
    succeeded. Failures are recorded in run.errors. Every request has its own HTTP timeout, and the
    joins are bounded too."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    out: list[dict[str, float] | None] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            out[i] = run.measure(prompts[i])
        except (RuntimeError, OSError, threading.BrokenBarrierError) as e:
            run.errors.append(f"concurrent: {str(e)[:300]}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 40
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [s for s in out if s is not None]
