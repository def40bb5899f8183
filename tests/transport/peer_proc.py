"""Holder and reader processes for the transport conformance suite (real, separate processes).

  python -m tests.transport.peer_proc hold --kind tcp --sizes 1048576,4096 [--opt k=v ...]
      registers regions filled with the deterministic pattern, prints ``META <hex>`` and serves
      until killed (SIGTERM closes cleanly). Dies with its parent (PR_SET_PDEATHSIG).
      ``--device-regions 0,2 --standin-delay S``: those regions are labelled cuda:0, backed by
      their CPU tensors and copied with an asynchronous CPU stand-in sleeping S before each op
      (the device bounce path, on CPU); on SIGTERM it prints ``STATS <json>`` of the transport's
      ``bounce_stats()`` before closing.
  python -m tests.transport.peer_proc read --kind tcp --meta HEX --remote-size N --block B --batch M
      reads a scattered plan, checks every byte, prints ``OK <i>`` per read; ``--loop`` repeats
      until killed. Typed errors print ``ERR <Type> <message>`` and exit 3; wrong bytes exit 2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import sys
import time

import numpy as np

from pdxfer.probe.pattern import fill, mismatches, scattered_plan
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion, TransportError


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan holders if pytest dies
    except (OSError, AttributeError):
        pass


def _opts(pairs: list[str]) -> dict:
    out: dict = {}
    for p in pairs:
        k, _, v = p.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def hold(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    bufs = []
    for i, n in enumerate(sizes):
        b = np.empty(n, dtype=np.uint8)
        fill(b, i, args.seed)
        bufs.append(b)
    on_device = {int(x) for x in args.device_regions.split(",") if x}
    opts = _opts(args.opt)
    if on_device:
        import torch

        from pdxfer.device import CpuStandIn

        opts["device_ops"] = CpuStandIn(asynchronous=True, delay_s=args.standin_delay)
    t = create_transport(args.kind, **opts)
    regions = []
    for i, b in enumerate(bufs):
        if i in on_device:
            regions.append(RegisteredRegion(i, b.ctypes.data, b.nbytes, "cuda:0", tensor=torch.from_numpy(b)))
        else:
            regions.append(RegisteredRegion(i, b.ctypes.data, b.nbytes))
    t.register(regions)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("META", t.metadata().hex(), flush=True)
    while not stop:
        time.sleep(0.2)  # the transport's own threads serve; this one only waits for SIGTERM
    if hasattr(t, "bounce_stats"):
        print("STATS", json.dumps(t.bounce_stats()), flush=True)
    t.close()
    return 0


def read(args: argparse.Namespace) -> int:
    dst = np.zeros(args.local_size or args.remote_size, dtype=np.uint8)
    t = create_transport(args.kind, **_opts(args.opt))
    try:
        t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
        peer = t.connect(bytes.fromhex(args.meta), timeout=args.timeout)
        i = 0
        while True:
            plan = scattered_plan(args.block, args.batch, args.remote_size, dst.nbytes, seed=args.seed + i)
            dst[:] = 0
            t.read(peer, plan).wait(args.timeout)
            bad = mismatches(plan, {0: dst}, {0: args.remote_size}, seed=args.pattern_seed)
            if bad:
                print("BAD", bad[0], flush=True)
                return 2
            print("OK", i, flush=True)
            i += 1
            if not args.loop and i >= args.iters:
                return 0
    except TransportError as exc:
        print("ERR", type(exc).__name__, exc, flush=True)
        return 3
    finally:
        t.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peer_proc")
    sub = ap.add_subparsers(dest="mode", required=True)
    h = sub.add_parser("hold")
    h.add_argument("--kind", required=True)
    h.add_argument("--sizes", required=True, help="comma-separated region sizes in bytes")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--opt", action="append", default=[], help="transport option key=value")
    h.add_argument("--device-regions", default="", help="comma-separated region indices labelled cuda:0")
    h.add_argument("--standin-delay", type=float, default=0.0, help="seconds the stand-in sleeps per op")
    r = sub.add_parser("read")
    r.add_argument("--kind", required=True)
    r.add_argument("--meta", required=True)
    r.add_argument("--remote-size", type=int, required=True)
    r.add_argument("--local-size", type=int, default=0)
    r.add_argument("--block", type=int, required=True)
    r.add_argument("--batch", type=int, required=True)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--pattern-seed", type=int, default=0)
    r.add_argument("--iters", type=int, default=1)
    r.add_argument("--loop", action="store_true")
    r.add_argument("--timeout", type=float, default=20.0)
    r.add_argument("--opt", action="append", default=[])
    args = ap.parse_args(argv)
    _die_with_parent()
    return hold(args) if args.mode == "hold" else read(args)


if __name__ == "__main__":
    sys.exit(main())
