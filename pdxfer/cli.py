"""`pdxfer` command line: one entry point, one subcommand per job.

Own subcommands: `launch` (master + N prefill + M decode instances + proxy on loopback), `proxy`
(the PD proxy and router alone), `make-tiny-model` (the tiny random Llama for tests and demos).

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

from pdxfer.common.cli_common import EXIT_OK, HelpFormatter, add_log_level, apply_log_level
from pdxfer.launch.tiny_model import TINY_ARCHS
from pdxfer.transport import KINDS

# name -> ("module:function", help). The function takes an argv list (or None) and returns an int.
FORWARDED: dict[str, tuple[str, str]] = {
    "master": ("pdxfer.master.service:main", "run the pdxfer master (same as pdxfer-master)"),
    "probe": ("pdxfer.probe.cli:main", "transport bandwidth/latency probe (same as pdxfer-probe)"),
    "status": ("pdxfer.master.client.status_cli:main", "the master's leader and every live node (read-only)"),
    "drain": ("pdxfer.serve.drain_cli:main", "take an instance out of the proxy's rotation, wait for its requests"),
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
                   help="KV transport between the instances")
    p.add_argument("--port", type=int, default=8000, help="proxy port on 127.0.0.1 (0: any free)")
    p.add_argument("--no-connector", action="store_true",
                   help="serve both instances without the pdxfer connector (decode recomputes)")
    p.add_argument("--master", metavar="HOST:PORT",
                   help="use a running master instead of starting an in-memory one")
    p.add_argument("--chunk-tokens", type=int, default=None, help="chunk size in tokens")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill instances")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode instances")
    p.add_argument("--prefill-cpus", action="append", default=[], metavar="CORES",
                   help="cores of one prefill instance, e.g. 0 or 0-3; once per instance "
                        "(default: the cores this process may use, split among all instances)")
    p.add_argument("--decode-cpus", action="append", default=[], metavar="CORES",
                   help="cores of one decode instance; once per instance")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance")
    p.add_argument("--log-dir", type=Path, default=None, help="where the logs go")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for readiness")
    p.add_argument("--no-restart", action="store_true",
                   help="stop everything when one process exits (default: start it again, the rest go on)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="restarts of one process within 10 minutes before it is left down")
    add_log_level(p)
    p.add_argument("--demo", action="store_true",
                   help="after readiness send a few prompts, print outputs and stats, then exit")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `vllm serve` (repeatable, e.g. --vllm-arg=--max-model-len=4096)")
    p.add_argument("--kv-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a kv_connector_extra_config entry for every instance (repeatable, e.g. "
                        "--kv-config publish_hint_wait_s=1); VALUE is read as JSON when it parses")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `pdxfer proxy` (repeatable, e.g. --proxy-arg=--skip-prefill-tokens=0)")


def _add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="prefill instance base URL, e.g. http://127.0.0.1:8100, or "
                        "dns+http://NAME:PORT: one instance per address NAME resolves to, "
                        "resolved again every --discovery-interval (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="decode instance base URL or dns+http://NAME:PORT (repeatable)")
    p.add_argument("--backends", type=Path, default=None, metavar="FILE",
                   help='JSON file {"prefill": [URL, ...], "decode": [URL, ...]} (added to the flags; '
                        "dns+http:// URLs too)")
    p.add_argument("--discovery-interval", type=float, default=5.0,
                   help="seconds between resolutions of the dns+http:// backends' names")
    p.add_argument("--discovery-timeout", type=float, default=2.0,
                   help="bound of one resolution, seconds (a failed one keeps the last known addresses)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    p.add_argument("--policy", choices=("round_robin", "least_loaded"), default="least_loaded",
                   help="how to choose when the index names no holder")
    p.add_argument("--timeout", type=float, default=300, help="per backend request, seconds")
    p.add_argument("--connect-timeout", type=float, default=5, help="backend connect, seconds")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks (GET /health) of every instance")
    p.add_argument("--health-timeout", type=float, default=2.0, help="bound of one health check, seconds")
    p.add_argument("--handoff", choices=("none", "nixl"), default="none",
                   help="none: decode finds KV through the pdxfer master; nixl: pass vLLM "
                        "NixlConnector kv_transfer_params from prefill to decode")
    p.add_argument("--prefill-failure", choices=("error", "decode"), default="decode",
                   help="when the prefill step fails on two instances: let decode compute the "
                        "prompt (decode, the default) or answer 502/504 (error)")
    p.add_argument("--master", metavar="HOST:PORT", default=None,
                   help="the pdxfer master (HOST:PORT, or etcd://... for a replica group's leader): "
                        "route from its index (skip the prefill of what the fleet holds, prefer "
                        "the instances holding a prompt's prefix)")
    p.add_argument("--master-token-file", type=Path, default=None, help="the master's shared secret")
    p.add_argument("--skip-prefill-tokens", type=int, default=256,
                   help="skip the prefill when at most this many prompt tokens are left to compute")
    p.add_argument("--skip-prefill-fraction", type=float, default=0.0,
                   help="... or at most this fraction of the prompt (0: off)")
    p.add_argument("--holder-max-extra-load", type=int, default=2,
                   help="prefer an instance holding the prompt's prefix only while it has at most "
                        "this many more requests in flight than the least loaded one")
    p.add_argument("--recent-prompt-tokens", type=int, default=1 << 18,
                   help="per instance, how many tokens of the prompts recently routed to it count "
                        "as held by its own prefix cache, in 16-token blocks (0: only the index)")
    p.add_argument("--index-timeout", type=float, default=1.0,
                   help="bound of tokenizing and asking the index, seconds (then: route without it)")
    p.add_argument("--load-cost-interval", type=float, default=5.0,
                   help="with --master: seconds between reads of each decode instance's measured "
                        "load and prefill costs from its /metrics (load_benefit on the decode), by "
                        "which a prefix held only in host tiers counts as loadable or not (0: never "
                        "read, it always counts)")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here")
    add_log_level(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdxfer", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_launch_args(sub.add_parser("launch", help="start master, prefill and decode instances, proxy",
                                    formatter_class=HelpFormatter))
    _add_proxy_args(sub.add_parser("proxy", help="run the PD proxy", formatter_class=HelpFormatter))
    t = sub.add_parser("make-tiny-model", help="build a tiny random model (Llama or a hybrid) + local tokenizer",
                       formatter_class=HelpFormatter)
    t.add_argument("out_dir", type=Path)
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    t.add_argument("--arch", choices=TINY_ARCHS, default="llama",
                   help="llama; sliding (Gemma 3 style: sliding-window attention on 4 of 6 layers, float32); "
                        "gdn (Qwen3-Next style: 3 gated-delta-net layers + 1 full-attention layer, bf16)")
    add_log_level(t)
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
    apply_log_level(args.log_level)
    if args.cmd == "make-tiny-model":
        from pdxfer.launch.tiny_model import make_tiny_model

        print(make_tiny_model(args.out_dir, seed=args.seed, arch=args.arch))
        return EXIT_OK
    if args.cmd == "proxy":
        from pdxfer.serve.proxy import run_proxy_cli

        return run_proxy_cli(args)
    if args.cmd == "launch":
        from pdxfer.launch.fleet import run_launch_cli

        return run_launch_cli(args)
    raise AssertionError(args.cmd)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
