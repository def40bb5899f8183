"""The prepared GPU check: device kernels and VRAM KV moves, PASS/FAIL lines and a summary.

    python -m tests.gpu.check              on a machine with an NVIDIA GPU (scripts/test.sh gpu
                                           builds the CUDA kernels first and runs this)
    python -m tests.gpu.check --standin    the same checks on CPU tensors through the asynchronous
                                           CPU stand-in device: how CI tests this harness

Exit status 0 when every check passed, 1 when one failed, 2 on bad arguments. Everything printed
also goes to ``--results``, else ``$OUT/gpu-check.txt`` when OUT is set, else
bench/results/gpu-check.txt (gpu-check-standin.txt for a stand-in run).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from tests.gpu.report import Report  # neither imports torch or pdxfer: the wheels go on sys.path first
from tests.gpu.wheels import fetch_hint, unpack_wheels

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "moves")
CORRUPTIBLE = ("kernel", "move")


def results_path(arg: str | None, standin: bool) -> Path:
    if arg:
        return Path(arg)
    name = "gpu-check-standin.txt" if standin else "gpu-check.txt"
    out = os.environ.get("OUT")
    return Path(out) / name if out else REPO / "bench" / "results" / name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--standin", action="store_true", help="CPU tensors through the asynchronous CPU stand-in")
    ap.add_argument("--mib", type=int, help="bytes per bench/native.py kernel case (default 128; stand-in 1)")
    ap.add_argument("--random", type=int, help="random kernel cases per group (default 300; stand-in 12)")
    ap.add_argument("--kv-mib", type=float, help="KV MiB per layer per move (default 64; stand-in 0.25)")
    ap.add_argument("--repeats", type=int, help="timed repeats (default 5; stand-in 2)")
    ap.add_argument("--seed", type=int, default=20261202, help="seed of the random kernel cases")
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only this section (repeatable)")
    ap.add_argument("--transports", default="nixl,tcp", help="transports of the moves, comma separated")
    ap.add_argument("--results", help="results file (default: see above)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no check after this many seconds (FAIL lines instead; 0: no limit)")
    ap.add_argument("--build-log", help="log of the CUDA build scripts/test.sh ran (kept in the results)")
    ap.add_argument("--build-rc", type=int, default=0, help="that build's exit status")
    # Hidden, for tests/unit/test_gpu_check_harness.py: damage one result so the test can see
    # that a wrong byte is reported as FAIL with a non-zero exit.
    ap.add_argument("--corrupt-for-test", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    small = a.standin
    a.mib = a.mib or (1 if small else 128)
    a.random = a.random if a.random is not None else (12 if small else 300)
    a.kv_mib = a.kv_mib or (0.25 if small else 64.0)
    a.repeats = a.repeats or (2 if small else 5)
    a.corrupt = {c for c in a.corrupt_for_test.split(",") if c}
    if a.corrupt - set(CORRUPTIBLE):
        ap.error(f"--corrupt-for-test takes {','.join(CORRUPTIBLE)}")
    a.kinds = [k for k in a.transports.split(",") if k]
    if not set(a.kinds) <= {"nixl", "tcp"}:
        ap.error(f"--transports takes nixl,tcp; got {a.transports!r}")
    if min(a.mib, a.repeats) <= 0 or a.random < 0 or a.kv_mib <= 0:
        ap.error("--mib, --repeats and --kv-mib must be positive, --random not negative")
    return a


def _section(rep: Report, name: str, fn: Callable[[], None]) -> None:
    if rep.out_of_time(name):
        return
    t0 = time.monotonic()
    rep.line(f"== {name}")
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a crashed section is a FAIL, and the next one still runs
        rep.failed(f"{name} (crashed)", f"{type(exc).__name__}: {exc}")
        for line in traceback.format_exc().strip().splitlines()[-6:]:
            rep.info(line)
    rep.info(f"{name}: {time.monotonic() - t0:.1f} s")


def _build_result(rep: Report, log: str, rc: int) -> None:
    """scripts/test.sh builds the CUDA kernels before this runs; its log goes into the results."""
    text = Path(log).read_text(errors="replace").strip().splitlines() if Path(log).exists() else []
    for line in text[-20:]:
        rep.info(f"build: {line}")
    rep.check("build native kernels (native/build.sh --cuda)", rc == 0,
              "built" if rc == 0 else f"exit status {rc}; the kernel checks below cannot pass")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    wheels = unpack_wheels()  # before anything imports NIXL

    import torch  # noqa: PLC0415 - after the wheels are on sys.path

    from tests.gpu import kernels, moves  # noqa: PLC0415
    from tests.gpu.target import Target, make_target  # noqa: PLC0415

    if not a.standin and not torch.cuda.is_available():
        print("gpu check: torch sees no CUDA device (--standin checks the harness on CPU)", file=sys.stderr)
        return 2
    rep = Report(results_path(a.results, a.standin), a.budget_s)
    try:
        t = make_target(a.standin)
    except Exception as exc:  # noqa: BLE001 - no device ops: the kernel checks FAIL, the moves still run
        rep.failed("device operations for cuda:0 (pdxfer.device.device_ops_for)", f"{type(exc).__name__}: {exc}")
        t = Target(None, "cuda:0", False)
    rep.line(f"pdxfer gpu check on {t.name()}")
    rep.info(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, python {platform.python_version()}, "
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, seed {a.seed}, kernel cases {a.mib} MiB, "
             f"moves {a.kv_mib:g} MiB per layer")
    rep.info("wheels: " + (", ".join(wheels) if wheels else f"none carried ({fetch_hint()})"))
    if t.ops is not None:
        rep.info(f"device ops: {type(t.ops).__name__}")
    if a.build_log:
        _build_result(rep, a.build_log, a.build_rc)
    only = a.only or list(SECTIONS)
    if "kernels" in only and t.ops is None:
        rep.failed("kernels", "not run: no device operations (see the first FAIL line)")
    elif "kernels" in only:
        _section(rep, "kernels: bench/native.py layout pairs", lambda: kernels.run_bench_cases(
            rep, t, a.mib, a.repeats, "kernel" in a.corrupt))
        _section(rep, "kernels: seeded random cases", lambda: kernels.run_random_cases(rep, t, a.seed, a.random))
        _section(rep, "kernels: bad run lists", lambda: kernels.run_bad_runs(rep, t))
        _section(rep, "device copies", lambda: kernels.run_copies(rep, t, a.seed))
    if "moves" in only:
        _section(rep, "moves: vLLM-shaped KV between two processes", lambda: moves.run_moves(
            rep, t, a.kinds, a.kv_mib, a.repeats, "move" in a.corrupt, fetch_hint()))
    rep.summary()
    rep.close()
    if t.ops is not None:
        t.ops.close()
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
