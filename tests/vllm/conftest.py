"""Real ``vllm serve`` pairs (prefill = kv_producer, decode = kv_consumer) of the tiny model on CPU,
with a real pdxfer-master, always stopped (process groups).

A start costs 45-75 s here, so modules whose tests need no config of their own share one pair of
:func:`make_pair`'s defaults (TCP) through fixture ``default_pair`` (tests/vllm/default_pair.py):
the tests using it run back to back, it starts before the first and stops after the last, and
each of them must leave it usable (or carry ``@pytest.mark.default_pair_order("last")``).
Counters on a shared pair move with every user: compare them only against a snapshot taken
before the work. Modules with a config of their own start their own pair with :func:`make_pair`.

The pair oracle (:func:`assert_decode_right`): a decode that loaded its prefix must give the same
top-k logprobs as the plain computation (the producer computing the prompt itself) within
:data:`LOGPROB_TOL`, and the request's own load must be what the test expects, as counted by
pdxfer (the decode's log line for that request) and by vLLM (the request's ``cached_tokens``,
and ``vllm:external_prefix_cache_hits`` in sequential tests). Greedy text alone is no oracle
with a random-weight model: wrong KV in a quarter of a prompt left 8 greedy tokens unchanged
while moving the top-5 logprobs by 0.5. :func:`assert_oracle_catches_corruption` proves the
oracle's power on each pair: loads corrupted on purpose (pdxfer.vllm.faults.load_corruption) must fail it.
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from pdxfer.contracts.prefill_step import prefill_step_params
from pdxfer.master import LocalMaster, start_local_master
from pdxfer.common.procs import ManagedProcess, free_port, wait_http_ready
from pdxfer.launch.plan import pdxfer_kv_config
from pdxfer.launch.serve_shim import start_vllm
from pdxfer.launch.tiny_model import default_tiny_model_dir, make_tiny_model

READY_TIMEOUT_S = 420  # cold start of two instances on two busy cores
REQUEST_TIMEOUT_S = 120
CHUNK = 256
# Pairs run in float32: greedy answers of a random-weight tiny model in bf16 flip in about 1 of 16
# requests between a batched run and a run alone, on one plain instance without any transfer, so a
# bf16 comparison of concurrent answers measures batch noise, not whether the KV was right.
# --enable-prompt-tokens-details: each answer carries vLLM's own count of the prompt tokens it
# did not compute (usage.prompt_tokens_details.cached_tokens: local prefix cache + connector).
PAIR_VLLM_ARGS = ("--dtype", "float32", "--enable-prompt-tokens-details")
TOP_K = 5
# Top-k logprobs (float32) of a decode that loaded its prefix vs the plain computation: correct
# loads were measured within 2e-6 to 1e-5 of it (float32 sums in another order: another batch,
# block size or chunking of the attention), wrong KV in one 64-token block of a 214-token prompt
# 0.42-0.50 away, and every corruption mode of the mutation check at least 0.02 away. 1e-3 sits
# two orders of magnitude from either side.
LOGPROB_TOL = 1e-3
LOG_WAIT_S = 5.0  # a load's log line is written in the step that concludes it: well before the answer


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_tiny_model(default_tiny_model_dir())


def post_json(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


# Like a P/D proxy: the kv_transfer_params an answer carried (the prefill's publish hint) go with
# the next request for the same prompt, so a decode waits for a publish still on its way.
_HINTS: dict[tuple[int, ...], dict] = {}


@dataclass
class Answer:
    """One completion: its text, per generated token its id and top-k logprobs, and vLLM's count
    of the prompt tokens it did not compute."""

    text: str
    tokens: list[str]  # "token_id:N"
    top: list[dict[str, float]]  # per generated token: {"token_id:N": logprob} of the top k
    cached_tokens: int | None
    request_id: str  # the X-Request-Id sent; vLLM's own id for it starts with "cmpl-<it>-"


def ask(port: int, prompt: list[int], max_tokens: int, forward_hint: bool = True,
        prefill_step: bool = False) -> Answer:
    """A greedy completion of token ids ``prompt`` from the instance on ``port``, with the top-k
    logprobs of each generated token; the prefill's publish hint is forwarded like a proxy does.
    ``prefill_step``: marked as the proxy marks a prefill step (its answer is thrown away)."""
    return ask_url(f"http://127.0.0.1:{port}", prompt, max_tokens, forward_hint, prefill_step)


def ask_url(base_url: str, prompt: list[int], max_tokens: int, forward_hint: bool = True,
            prefill_step: bool = False) -> Answer:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": TOP_K, "return_tokens_as_token_ids": True}
    if forward_hint and tuple(prompt) in _HINTS:
        body["kv_transfer_params"] = _HINTS[tuple(prompt)]
    if prefill_step:
        body["kv_transfer_params"] = {**body.get("kv_transfer_params", {}), **prefill_step_params()}
    rid = f"t-{uuid.uuid4().hex[:16]}"
    out = post_json(f"{base_url}/v1/completions", body, headers={"X-Request-Id": rid})
    if out.get("kv_transfer_params"):
        _HINTS[tuple(prompt)] = out["kv_transfer_params"]
    choice = out["choices"][0]
    lp = choice.get("logprobs") or {}
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return Answer(choice["text"], list(lp.get("tokens") or []), [dict(t or {}) for t in lp.get("top_logprobs") or []],
                  details.get("cached_tokens"), rid)


def complete(port: int, prompt: list[int], max_tokens: int, forward_hint: bool = True) -> str:
    return ask(port, prompt, max_tokens, forward_hint).text


class OracleMismatch(AssertionError):
    """The pair oracle found a decode that differs from the plain computation; ``what`` says in
    what: "loaded" / "cached" (the request's own load), "logprobs" or "text" (the KV was wrong)."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"{what}: {detail}")
        self.what = what


def check_logprobs(got: Answer, ref: Answer, tol: float = LOGPROB_TOL) -> float:
    """Raise OracleMismatch unless ``got``'s top-k logprobs are within ``tol`` of ``ref``'s at every
    generated token; returns the largest difference seen. A token in one top-k only is allowed
    only as a near-tie at the k-th place (its logprob within ``tol`` of the other's k-th)."""
    if not ref.top or len(ref.top) != len(ref.tokens):
        raise ValueError("the reference answer has no logprobs: ask() it with logprobs")
    if len(got.top) != len(got.tokens):
        raise OracleMismatch("logprobs", f"the answer has logprobs for {len(got.top)} of {len(got.tokens)} tokens")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got.top, ref.top)):
        for tok in set(g) | set(r):
            if tok in g and tok in r:
                d = abs(g[tok] - r[tok])
            else:
                mine, other = (g, r) if tok in g else (r, g)
                d = max(0.0, mine[tok] - min(other.values()))
            worst = max(worst, d)
            if d > tol:
                raise OracleMismatch("logprobs", f"generated token {i}: {tok} has logprob {g.get(tok)} in the "
                                     f"decode, {r.get(tok)} plain; {d:.3g} apart (tolerance {tol})")
        if got.tokens[i] != ref.tokens[i]:  # a near-tie went the other way: nothing to compare beyond
            raise OracleMismatch("text", f"generated token {i} is {got.tokens[i]}, plain {ref.tokens[i]}")
    if got.tokens != ref.tokens or got.text != ref.text:
        raise OracleMismatch("text", f"{got.text!r} vs plain {ref.text!r}")
    return worst


_LOADED = re.compile(r"pdxfer: loaded (\d+) tokens \(.*\) for (\S+) in ")
_FAILED = re.compile(r"pdxfer: load of (\d+) tokens for (\S+) failed \((.*)\); recomputing")
_CORRUPTED = re.compile(r"pdxfer test hook corrupt_load: corrupted the load of (\S+) ")


@dataclass
class RequestLoads:
    """What the decode's pdxfer worker logged about one request's loads (tokens per load)."""

    loaded: list[int]
    failed: list[int]
    corrupted: int
    reasons: list[str] = field(default_factory=list)  # per failed load, why (the connector's words)


def request_loads(log_path: Path, request_id: str) -> RequestLoads:
    prefix = f"cmpl-{request_id}-"
    out = RequestLoads([], [], 0)
    for line in log_path.read_text(errors="replace").splitlines():
        if prefix not in line:
            continue
        if (m := _LOADED.search(line)) and m.group(2).startswith(prefix):
            out.loaded.append(int(m.group(1)))
        elif (m := _FAILED.search(line)) and m.group(2).startswith(prefix):
            out.failed.append(int(m.group(1)))
            out.reasons.append(m.group(3))
        elif (m := _CORRUPTED.search(line)) and m.group(1).startswith(prefix):
            out.corrupted += 1
    return out


def assert_decode_right(pair: "PDPair", got: Answer, ref: Answer, loaded: int | None,
                        cached: int | None = None, tol: float = LOGPROB_TOL) -> float:
    """The pair oracle for one decode answer ``got`` against the plain answer ``ref``.

    ``loaded``: the tokens this request's own load must have brought (pdxfer's log line for it,
    one successful load, no failed one); None: not checked here (a fault test checks the load).
    ``cached``: vLLM's own count of prompt tokens the request did not compute (default:
    ``loaded``; differs when part of the prompt was in the decode's local prefix cache).
    Raises OracleMismatch; returns the largest logprob difference.
    """
    if loaded is not None:
        own = pair.request_loads(got.request_id, until=lambda r: len(r.loaded) + len(r.failed) >= pair.decode_ranks)
        # Each TP rank of the decode logs its share of the load.
        if own.loaded != [loaded] * pair.decode_ranks or own.failed:
            raise OracleMismatch("loaded", f"request {got.request_id}: loads of {own.loaded} tokens, failed "
                                 f"{own.failed}; expected one load of {loaded} on each of "
                                 f"{pair.decode_ranks} rank(s)")
        want = loaded if cached is None else cached
        if got.cached_tokens != want:
            raise OracleMismatch("cached", f"request {got.request_id}: vLLM counts {got.cached_tokens} prompt "
                                 f"tokens not computed, expected {want}")
    return check_logprobs(got, ref, tol)


def through_pair(pair: "PDPair", prompt: list[int], max_tokens: int) -> Answer:
    """As a proxy sends it: the prefill step (publishes the prompt, tail included), then the decode."""
    ask(pair.prefill_port, prompt, 1, prefill_step=True)
    return ask(pair.decode_port, prompt, max_tokens)


def pair_oracle(pair: "PDPair", prompt: list[int], max_tokens: int, loaded: int | None = None,
                tol: float = LOGPROB_TOL) -> tuple[Answer, float]:
    """A fresh prompt through the pair, checked by the oracle against the producer computing it
    alone, and vLLM's connector hit counter for it (sequential use only: the counter is global).
    ``loaded`` defaults to every prompt token but the last. Returns the decode's answer and the
    largest logprob difference; raises OracleMismatch."""
    loaded = len(prompt) - 1 if loaded is None else loaded
    ref = ask(pair.prefill_port, prompt, max_tokens)  # the producer alone (kv_producer never loads)
    hits = pair.external_hits()
    got = through_pair(pair, prompt, max_tokens)
    seen = wait_metric(pair.decode_port, EXTERNAL_HITS, hits + loaded) - hits
    if seen != loaded:
        raise OracleMismatch("cached", f"vLLM's {EXTERNAL_HITS} grew by {seen:.0f} for the request, expected {loaded}")
    worst = assert_decode_right(pair, got, ref, loaded, tol=tol)
    print(f"pair oracle: {len(prompt)}-token prompt, top-{TOP_K} logprobs within {worst:.2g} of plain")  # for -rA
    return got, worst


def assert_oracle_catches_corruption(pair: "PDPair", n_tokens: int, seed: int, max_tokens: int,
                                     modes: tuple[str, ...] = ("shift", "zero_layer", "other"),
                                     tol: float = LOGPROB_TOL) -> None:
    """Mutation check of the oracle on this pair: loads corrupted on purpose in each mode, which
    pdxfer and vLLM still count as full successes, must fail the oracle on the KV (logprobs or
    text). Leaves the decode's prefix cache empty (the corrupted blocks were in it)."""
    try:
        # "other" takes a block that an earlier corrupted load filled: it comes last.
        for i, mode in enumerate(modes):
            prompt = prompt_of(n_tokens, seed=seed + i)
            ref = ask(pair.prefill_port, prompt, max_tokens)
            pair.set_hook("corrupt_load", mode)
            try:
                got = through_pair(pair, prompt, max_tokens)
            finally:
                pair.set_hook("corrupt_load", None)
            ranks = pair.decode_ranks
            own = pair.request_loads(got.request_id, until=lambda r: r.corrupted >= ranks and len(r.loaded) >= ranks)
            assert own.corrupted == ranks and own.loaded == [n_tokens - 1] * ranks, f"mode {mode}: {own}"
            with pytest.raises(OracleMismatch) as caught:
                worst = assert_decode_right(pair, got, ref, n_tokens - 1, tol=tol)
                pytest.fail(f"mode {mode}: the oracle passed a corrupted load (logprobs within {worst:.3g})")
            assert caught.value.what in ("logprobs", "text"), f"mode {mode}: {caught.value}"
            print(f"corruption mode {mode} caught: {caught.value}")  # the margin, for -rA
    finally:
        post_json(f"http://127.0.0.1:{pair.decode_port}/reset_prefix_cache", {})


EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# vLLM's time from a request's arrival to the start of the step that schedules its compute: the
# steps it waited through (for a hinted publish, for its KV load: a request loading
# asynchronously is scheduled once the load ended), lookups in those steps included; not its
# compute, nor the work of the step that schedules it (a lookup answered there at once).
QUEUE_TIME = "vllm:request_queue_time_seconds"
_METRIC = re.compile(r"^(vllm:pdxfer_\w+|vllm:external_prefix_cache_\w+|vllm:request_queue_time_seconds_(?:sum|count))"
                     r"\{[^}]*\} ([0-9.e+-]+)$")


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


def poll_metrics(port: int, done: Callable[[dict[str, float]], bool], timeout: float = 10.0) -> dict[str, float]:
    """/metrics once ``done`` holds for it, or the last one read after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(port)
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def wait_metrics(port: int, want: dict[str, float], timeout: float = 10.0) -> dict[str, float]:
    """/metrics once every counter in ``want`` reached its value (bounded): the caller then
    compares exactly, so a counter that overshot fails there."""
    return poll_metrics(port, lambda m: all(m.get(k, 0.0) >= v for k, v in want.items()), timeout)


def queue_wait(port: int, request: Callable[[], Any]) -> tuple[float, Any]:
    """vLLM's queue time of the one request ``request()`` sends to the instance on ``port``
    (nothing else may run there meanwhile), and what ``request()`` returned."""
    count, total = QUEUE_TIME + "_count", QUEUE_TIME + "_sum"
    before = metrics(port)
    out = request()
    after = wait_metrics(port, {count: before.get(count, 0.0) + 1})
    n = after.get(count, 0.0) - before.get(count, 0.0)
    assert n == 1, f"{n:.0f} requests finished at port {port} meanwhile; expected this one alone"
    return after[total] - before.get(total, 0.0), out


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
    """Each (length, seed) prompt through the pair as a proxy sends it, checked by the pair
    oracle: it loaded every prompt token but the last, and its logprobs equal the producer's own."""
    for n_tokens, seed in prompts:
        pair_oracle(pair, prompt_of(n_tokens, seed=seed), max_tokens)


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
    # kv_both on both sides makes a pair that moves KV both ways (each side publishes what it
    # computed and reads what the other holds): one start-up tests two directions.
    prefill_role: str = "kv_producer"
    decode_role: str = "kv_consumer"

    def start_master(self) -> None:
        # A fixed port (chosen free once) lets a restarted master be found at the same address.
        self.master = start_local_master(workdir=self.run_dir, log_name="master.log",
                                         extra_args=["--port", str(self.master_port)])
        self.master_addr = self.master.address

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the master and both instances without waiting for them (start-ups overlap)."""
        self.master_port = free_port()
        self.hooks = self.run_dir / "hooks"
        self.hooks.mkdir(parents=True, exist_ok=True)
        self.start_master()
        self.prefill_port, self.decode_port = free_port(), free_port()
        # A generous publish-hint wait: a loaded CI box may take a while to land a publish.
        common = {"lock_ttl_s": 5.0, "lease_ttl_s": 4.0, "load_timeout_s": 5.0, "publish_hint_wait_s": 3.0,
                  **self.extra_cfg}
        p_cfg = pdxfer_kv_config(self.prefill_role, self.master_addr, self.transport, **common)
        # These pairs test the prefill -> decode path; a decode holding its own chunks (the
        # default, tested by the connector-flow and fleet tests) keeps blocks in use, and vLLM
        # then refuses the /reset_prefix_cache these tests use to force a second remote load.
        d_extra = {"publish_as_decode": False} if self.decode_role == "kv_consumer" else {}
        d_cfg = pdxfer_kv_config(self.decode_role, self.master_addr, self.transport, **{**d_extra, **common})
        self.prefill = start_vllm(self.model, self.prefill_port, p_cfg,
                                  cpu_bind=self.prefill_bind, log_dir=self.run_dir, name=f"prefill-{self.transport}",
                                  extra_args=PAIR_VLLM_ARGS + self.prefill_args,
                                  extra_env={"PDXFER_TEST_HOOKS_DIR": str(self.hooks), **self.extra_env})
        self.decode = start_vllm(self.model, self.decode_port, d_cfg,
                                 cpu_bind=self.decode_bind, log_dir=self.run_dir, name=f"decode-{self.transport}",
                                 extra_args=PAIR_VLLM_ARGS + self.decode_args,
                                 extra_env={"PDXFER_TEST_HOOKS_DIR": str(self.hooks),
                                            "VLLM_SERVER_DEV_MODE": "1", **self.extra_env})

    def wait_ready(self) -> None:
        wait_http_ready(f"http://127.0.0.1:{self.prefill_port}/health", READY_TIMEOUT_S, self.prefill)
        wait_http_ready(f"http://127.0.0.1:{self.decode_port}/health", READY_TIMEOUT_S, self.decode)

    def stop(self) -> None:
        stop_all([self.decode, self.prefill, self.master])

    def set_hook(self, name: str, value: float | str | None) -> None:
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

    @property
    def decode_ranks(self) -> int:
        args = list(self.decode_args)
        return int(args[args.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in args else 1

    def request_loads(self, request_id: str, until: Callable[[RequestLoads], bool] = lambda r: True,
                      timeout: float = LOG_WAIT_S) -> RequestLoads:
        """The decode's log about ``request_id``'s loads; polls (bounded) until ``until`` holds."""
        assert self.decode is not None
        deadline = time.monotonic() + timeout
        while True:
            got = request_loads(self.decode.log_path, request_id)
            if until(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def external_hits(self) -> float:
        return metrics(self.decode_port).get(EXTERNAL_HITS, 0.0)

    def loaded_tokens(self) -> float:
        return metrics(self.decode_port).get("vllm:pdxfer_tokens_loaded_total", 0.0)

    def failed_loads(self) -> float:
        return metrics(self.decode_port).get("vllm:pdxfer_loads_failed_total", 0.0)


def stop_all(procs: list[Any], timeout: float = 15) -> None:
    """Stop processes (anything with ``stop(timeout)``) at the same time: a pair's teardown
    then costs its slowest process, not the sum of them."""
    import threading

    threads = [threading.Thread(target=p.stop, args=(timeout,), daemon=True) for p in procs if p is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)  # stop() ends with a SIGKILL and a bounded reap


def make_pair(tmp_path_factory: pytest.TempPathFactory, model: Path, transport: str,
              prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
              prefill_bind: str = "0", decode_bind: str = "1", extra_cfg: dict | None = None,
              extra_env: dict | None = None, prefill_role: str = "kv_producer",
              decode_role: str = "kv_consumer"):
    pair = PDPair(tmp_path_factory.mktemp(f"pd-{transport}"), model, transport,
                  prefill_args=prefill_args, decode_args=decode_args, prefill_bind=prefill_bind,
                  decode_bind=decode_bind, extra_cfg=dict(extra_cfg or {}), extra_env=dict(extra_env or {}),
                  prefill_role=prefill_role, decode_role=decode_role)
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()


def pytest_configure(config: pytest.Config) -> None:
    from tests.vllm.default_pair import register_default_pair

    register_default_pair(config)


def kill_process_groups(pgids: list[int]) -> None:
    """SIGKILL what is left of a launched stack's process groups (a test's last resort)."""
    import os
    import signal

    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
