"""`pdxfer` command line: one entry point, one subcommand per job.

Own subcommands: `launch` (master + prefill + decode + proxy on loopback), `proxy` (the PD proxy
alone), `make-tiny-model` (the tiny random Llama for tests and demos).

Other parts hook in through FORWARDED: `pdxfer NAME ARGS...` calls `module:function(ARGS)` of the
part that owns NAME (its own argparse parses ARGS). Add an entry there to expose a new tool; a
missing module (a part not landed yet) gives a clear error rather than a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Callable, Sequence

from pdxfer.transport import KINDS

# name -> ("module:function", help). The function takes an argv list (or None) and returns an int.
FORWARDED: dict[str, tuple[str, str]] = {
    "master": ("pdxfer.master.service:main", "run the pdxfer master (same as pdxfer-master)"),
    "probe": ("pdxfer.probe.cli:main", "transport bandwidth/latency probe (same as pdxfer-probe)"),
}


def _resolve(target: str) -> Callable[..., int | None]:
    mod_name, func_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise SystemExit(f"pdxfer: {target} is not available ({e})") from e
    return getattr(mod, func_name)


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="model directory (config.json, weights, tokenizer)")
    p.add_argument("--make-tiny-model", metavar="DIR",
                   help="build (or reuse) the tiny random Llama in DIR and serve it")
    p.add_argument("--transport", choices=KINDS, default="tcp",
                   help="KV transport between the instances (default tcp)")
    p.add_argument("--port", type=int, default=8000, help="proxy port on 127.0.0.1 (0: any free)")
    p.add_argument("--no-connector", action="store_true",
                   help="serve both instances without the pdxfer connector (decode recomputes)")
    p.add_argument("--master", metavar="HOST:PORT",
                   help="use a running master instead of starting an in-memory one")
    p.add_argument("--chunk-tokens", type=int, default=None, help="chunk size in tokens")
    p.add_argument("--prefill-cpus", default=None,
                   help="cores for the prefill instance, e.g. 0 or 0-3 (default: first half of "
                        "the cores this process may use)")
    p.add_argument("--decode-cpus", default=None,
                   help="cores for the decode instance (default: the other half)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance")
    p.add_argument("--log-dir", type=Path, default=None, help="where the logs go")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for readiness")
    p.add_argument("--demo", action="store_true",
                   help="after readiness send a few prompts, print outputs and stats, then exit")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for both `vllm serve` (repeatable, e.g. --vllm-arg=--max-model-len=4096)")


def _add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="prefill instance base URL, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="decode instance base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=("round_robin", "least_loaded"), default="least_loaded")
    p.add_argument("--timeout", type=float, default=300, help="per backend request, seconds")
    p.add_argument("--connect-timeout", type=float, default=5, help="backend connect, seconds")
    p.add_argument("--handoff", choices=("none", "nixl"), default="none",
                   help="none: decode finds KV through the pdxfer master; nixl: pass vLLM "
                        "NixlConnector kv_transfer_params from prefill to decode")
    p.add_argument("--prefill-failure", choices=("error", "decode"), default="error",
                   help="when prefill fails: answer 502/504 (error) or let decode compute (decode)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdxfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_launch_args(sub.add_parser("launch", help="start master, prefill, decode and proxy"))
    _add_proxy_args(sub.add_parser("proxy", help="run the PD proxy"))
    t = sub.add_parser("make-tiny-model", help="build the tiny random Llama + local tokenizer")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--seed", type=int, default=0)
    for name, (_, help_text) in FORWARDED.items():
        fp = sub.add_parser(name, help=help_text, add_help=False)
        fp.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        rc = _resolve(FORWARDED[argv[0]][0])(argv[1:])
        return int(rc or 0)
    args = build_parser().parse_args(argv)
    if args.cmd == "make-tiny-model":
        from pdxfer.serve.tiny_model import make_tiny_model

        print(make_tiny_model(args.out_dir, seed=args.seed))
        return 0
    if args.cmd == "proxy":
        from pdxfer.serve.proxy import run_proxy_cli

        return run_proxy_cli(args)
    if args.cmd == "launch":
        from pdxfer.serve.launch import run_launch_cli

        return run_launch_cli(args)
    raise AssertionError(args.cmd)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
