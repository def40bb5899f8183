"""Real ``vllm serve`` pairs (prefill = kv_producer, decode = kv_consumer) of the tiny model on CPU,
with a real pdxfer-master, started once per test module and always stopped (process groups).
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from pdxfer.master import LocalMaster, start_local_master
from pdxfer.procs import ManagedProcess, free_port, wait_http_ready
from pdxfer.vllm.launch import pdxfer_kv_config
from pdxfer.vllm.serve_shim import start_vllm
from pdxfer.vllm.tiny_model import default_tiny_model_dir, make_tiny_model

READY_TIMEOUT_S = 420  # cold start of two instances on two busy cores
REQUEST_TIMEOUT_S = 120
CHUNK = 256
# Pairs run in float32: greedy answers of a random-weight tiny model in bf16 flip in about 1 of 16
# requests between a batched run and a run alone, on one plain instance without any transfer, so a
# bf16 comparison of concurrent answers measures batch noise, not whether the KV was right.
PAIR_VLLM_ARGS = ("--dtype", "float32")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_tiny_model(default_tiny_model_dir())


def post_json(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


# Like a P/D proxy: the kv_transfer_params an answer carried (the prefill's publish hint) go with
# the next request for the same prompt, so a decode waits for a publish still on its way.
_HINTS: dict[tuple[int, ...], dict] = {}


def complete(port: int, prompt: list[int], max_tokens: int, forward_hint: bool = True) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if forward_hint and tuple(prompt) in _HINTS:
        body["kv_transfer_params"] = _HINTS[tuple(prompt)]
    out = post_json(f"http://127.0.0.1:{port}/v1/completions", body)
    if out.get("kv_transfer_params"):
        _HINTS[tuple(prompt)] = out["kv_transfer_params"]
    return out["choices"][0]["text"]


_METRIC = re.compile(r"^(vllm:pdxfer_\w+|vllm:external_prefix_cache_\w+)\{[^}]*\} ([0-9.e+-]+)$")


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_metric(port: int, name: str, at_least: float, timeout: float = 10.0) -> float:
    """Stats reach Prometheus one engine step after the event: poll, with a bound."""
    deadline = time.monotonic() + timeout
    while True:
        v = metrics(port).get(name, 0.0)
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


@pytest.fixture(scope="module")
def master():
    """An in-memory master of the module's own (connector tests without vLLM)."""
    m = start_local_master()
    try:
        yield m
    finally:
        m.stop()


def finish_request(sched: Any, pool: Any, block_size: int, rid: str, tokens: list[int]) -> tuple[list[int], int]:
    """A request that computed ``tokens`` locally, then finished (its own block refs dropped), on
    a connector's scheduler half without an engine: its block ids and the tokens its publish covers."""
    blocks = pool.get_new_blocks(-(-len(tokens) // block_size))
    ids = [b.block_id for b in blocks]
    published = sched.request_finished(rid, tokens, ids, None)
    pool.free_blocks(blocks)
    return ids, published


def wait_until(done: Callable[[], Any], what: str, timeout: float = 10.0, poll: float = 0.02) -> None:
    """Poll ``done`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(poll)


def decode_loads_all_but_last(pair: "PDPair", prompts: list[tuple[int, int]], max_tokens: int) -> None:
    """Each (length, seed) prompt through the pair as a proxy sends it: the decode's greedy answer
    equals the producer's own, and it loaded every prompt token but the last."""
    for n_tokens, seed in prompts:
        prompt = prompt_of(n_tokens, seed=seed)
        ref = complete(pair.prefill_port, prompt, max_tokens)  # the producer alone
        complete(pair.prefill_port, prompt, 1)  # the proxy's prefill step: publishes the prompt's tail
        before = pair.loaded_tokens()
        assert complete(pair.decode_port, prompt, max_tokens) == ref
        got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + n_tokens - 1) - before
        assert got == n_tokens - 1


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


@dataclass
class PDPair:
    run_dir: Path
    model: Path
    transport: str
    master_port: int = 0
    master: LocalMaster | None = None
    master_addr: str = ""
    prefill: ManagedProcess | None = None
    decode: ManagedProcess | None = None
    prefill_port: int = 0
    decode_port: int = 0
    hooks: Path = field(default_factory=Path)
    prefill_args: tuple[str, ...] = ()  # extra `vllm serve` flags per side (e.g. --block-size)
    decode_args: tuple[str, ...] = ()
    prefill_bind: str = "0"  # VLLM_CPU_OMP_THREADS_BIND: cores per TP rank, ranks split by "|"
    decode_bind: str = "1"
    extra_cfg: dict = field(default_factory=dict)  # more kv_connector_extra_config for both sides
    extra_env: dict = field(default_factory=dict)  # more environment for both `vllm serve`s

    def start_master(self) -> None:
        # A fixed port (chosen free once) lets a restarted master be found at the same address.
        self.master = start_local_master(workdir=self.run_dir, log_name="master.log",
                                         extra_args=["--port", str(self.master_port)])
        self.master_addr = self.master.address

    def start(self) -> None:
        self.master_port = free_port()
        self.hooks = self.run_dir / "hooks"
        self.hooks.mkdir(parents=True, exist_ok=True)
        self.start_master()
        self.prefill_port, self.decode_port = free_port(), free_port()
        # A generous publish-hint wait: a loaded CI box may take a while to land a publish.
        common = {"lock_ttl_s": 5.0, "lease_ttl_s": 4.0, "load_timeout_s": 5.0, "publish_hint_wait_s": 3.0,
                  **self.extra_cfg}
        p_cfg = pdxfer_kv_config("kv_producer", self.master_addr, self.transport, **common)
        d_cfg = pdxfer_kv_config("kv_consumer", self.master_addr, self.transport, **common)
        self.prefill = start_vllm(self.model, self.prefill_port, p_cfg,
                                  cpu_bind=self.prefill_bind, log_dir=self.run_dir, name=f"prefill-{self.transport}",
                                  extra_args=PAIR_VLLM_ARGS + self.prefill_args,
                                  extra_env={"PDXFER_TEST_HOOKS_DIR": str(self.hooks), **self.extra_env})
        self.decode = start_vllm(self.model, self.decode_port, d_cfg,
                                 cpu_bind=self.decode_bind, log_dir=self.run_dir, name=f"decode-{self.transport}",
                                 extra_args=PAIR_VLLM_ARGS + self.decode_args,
                                 extra_env={"PDXFER_TEST_HOOKS_DIR": str(self.hooks),
                                            "VLLM_SERVER_DEV_MODE": "1", **self.extra_env})
        wait_http_ready(f"http://127.0.0.1:{self.prefill_port}/health", READY_TIMEOUT_S, self.prefill)
        wait_http_ready(f"http://127.0.0.1:{self.decode_port}/health", READY_TIMEOUT_S, self.decode)

    def stop(self) -> None:
        for p in (self.decode, self.prefill, self.master):
            if p is not None:
                p.stop(15)

    def set_hook(self, name: str, value: float | None) -> None:
        path = self.hooks / name
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(str(value))

    def published_at_master(self) -> int:
        from pdxfer.master import MasterClient

        with MasterClient(self.master_addr, timeout_s=5.0) as c:
            return int(c.stats()["published"])

    def wait_published(self, at_least: int, timeout: float = 10.0) -> int:
        """The prefill answers before its publish lands (issue 12): a test that then kills or
        freezes it waits here for the master to have the chunks, with a bound."""
        deadline = time.monotonic() + timeout
        while True:
            n = self.published_at_master()
            if n >= at_least or time.monotonic() > deadline:
                return n
            time.sleep(0.05)

    def loaded_tokens(self) -> float:
        return metrics(self.decode_port).get("vllm:pdxfer_tokens_loaded_total", 0.0)

    def failed_loads(self) -> float:
        return metrics(self.decode_port).get("vllm:pdxfer_loads_failed_total", 0.0)


def make_pair(tmp_path_factory: pytest.TempPathFactory, model: Path, transport: str,
              prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
              prefill_bind: str = "0", decode_bind: str = "1", extra_cfg: dict | None = None,
              extra_env: dict | None = None):
    pair = PDPair(tmp_path_factory.mktemp(f"pd-{transport}"), model, transport,
                  prefill_args=prefill_args, decode_args=decode_args, prefill_bind=prefill_bind,
                  decode_bind=decode_bind, extra_cfg=dict(extra_cfg or {}), extra_env=dict(extra_env or {}))
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()
