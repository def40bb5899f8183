"""pdxfer-probe: bandwidth/latency of pdxfer transports, in the spirit of nixlbench/ib_read_bw.

  pdxfer-probe --loopback [--transport tcp] [--block-sizes 32KiB,16MiB] [--batches 1,4096]
               [--baseline] [--check] [--json FILE] [--plot FILE.png] [--memory cpu|cuda:N]
  pdxfer-probe serve --host 0.0.0.0 --port 7555 [--memory cuda:0]  # on the holder node
  pdxfer-probe read --peer HOST:7555 [same sweep options]            # on the reader node
  pdxfer-probe --devices                                             # RDMA devices, GPU <-> NIC topology

``--memory cuda:N`` puts the regions on that GPU (host memory is the default); a host without
it is refused at once. A transport that cannot register the region is skipped, said so on
stderr: tcp, whose pinned bounce buffer needs the region's tensor, which the probe does not pass.

Prints one nixlbench-like line per point as it completes. Points whose block x batch exceeds
the holder's region are skipped (said so on stderr).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from pdxfer.common.cli_common import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_UNREACHABLE, HelpFormatter,
                               add_log_level, apply_log_level)
from pdxfer.probe import regions, report, server, sweep
from pdxfer.probe.pattern import mismatches
from pdxfer.transport import KINDS, create_transport, transport_options
from pdxfer.transport.base import RegisteredRegion, TransportError
from pdxfer.transport.nixl.env import prepare_ucx_env

# Before NIXL/UCX can load here or in the holder this spawns (it inherits the environment).
prepare_ucx_env()

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
DEFAULT_BLOCKS = "4KiB,16KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB"
DEFAULT_BATCHES = "1,64,4096"


def parse_size(text: str) -> int:
    """'32KiB' -> 32768 (binary units; K/M/G and KB/MB/GB mean the same here)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 32KiB, 16MiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_list(text: str, item) -> list[int]:
    try:
        vals = [item(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"need a comma-separated list of positive values, got {text!r}")
    return vals


def _add_sweep_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--transport", action="append", choices=KINDS,
                    help="transport to measure (repeatable; default: every one the holder serves)")
    ap.add_argument("--block-sizes", type=lambda s: parse_list(s, parse_size), default=DEFAULT_BLOCKS,
                    help="comma-separated block sizes (4KiB,1MiB,...)")
    ap.add_argument("--batches", type=lambda s: parse_list(s, int), default=DEFAULT_BATCHES,
                    help="comma-separated blocks per read")
    ap.add_argument("--iters", type=int, default=0, help="timed iterations per point (0: auto)")
    ap.add_argument("--target-mib", type=int, default=512, help="auto iterations move about this much")
    ap.add_argument("--baseline", action="store_true", help="also measure raw baselines in the same run")
    ap.add_argument("--check", action="store_true", help="verify every byte of each point")
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list")
    ap.add_argument("--plot", metavar="FILE.png", help="bandwidth vs block size per transport")
    ap.add_argument("--label", help="name rows by this instead of the transport (e.g. nixl-ucx-tcp)")
    ap.add_argument("--tcp-connections", type=int, default=2, help="parallel TCP connections per peer")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound on any single read")
    ap.add_argument("--quiet", action="store_true", help="no live lines, only the final table")
    ap.add_argument("--cpu", action="store_true",
                    help="also measure CPU seconds per GB on reader and holder (and raw socket baseline)")
    ap.add_argument("--memory", type=regions.parse_memory, default="cpu",
                    help="where the reader's region lives: cpu or cuda:N (and the loopback holder's)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdxfer-probe", description=__doc__,
                                 formatter_class=HelpFormatter)
    add_log_level(ap)
    sub = ap.add_subparsers(dest="mode")
    s = sub.add_parser("serve", help="hold a region and serve it over every available transport",
                       formatter_class=HelpFormatter)
    add_log_level(s, argparse.SUPPRESS)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=0, help="control port (0: any free)")
    s.add_argument("--advertise", help="address readers should use (default: --host)")
    s.add_argument("--region-size", type=parse_size, default=parse_size("256MiB"), help="bytes held")
    s.add_argument("--transport", action="append", choices=KINDS)
    s.add_argument("--memory", type=regions.parse_memory, default="cpu", help="cpu or cuda:N")
    r = sub.add_parser("read", help="sweep against a running `pdxfer-probe serve`",
                       formatter_class=HelpFormatter)
    add_log_level(r, argparse.SUPPRESS)
    r.add_argument("--peer", required=True, help="HOST:PORT of the serve control port")
    _add_sweep_args(r)
    ap.add_argument("--loopback", action="store_true", help="spawn a holder process on this host (default)")
    ap.add_argument("--region-size", type=parse_size, default=parse_size("256MiB"),
                    help="bytes of the loopback region")
    _add_sweep_args(ap)
    return ap


def spawn_loopback(region_size: int, kinds: list[str] | None, timeout: float = 120.0,
                   memory: str = "cpu") -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pdxfer.probe.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--region-size", str(region_size), "--memory", memory]
    for k in kinds or []:
        cmd += ["--transport", k]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    import select
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("PROBE-SERVE "):
            return proc, line.split()[1]
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"loopback probe server did not start within {timeout}s (rc {proc.poll()})")


def run_sweep(args: argparse.Namespace, peer_addr: str) -> list[dict[str, Any]]:
    host, _, port = peer_addr.rpartition(":")
    addr = (host, int(port))
    hello = server.control_request(addr, {"op": "hello"})
    region = int(hello["region_size"])
    kinds = args.transport or hello["kinds"]
    for k in kinds:
        if k not in hello["kinds"]:
            why = hello.get("unavailable", {}).get(k, "not served")
            print(f"pdxfer-probe: skipping {k}: holder does not serve it ({why})", file=sys.stderr)
    kinds = [k for k in kinds if k in hello["kinds"]]
    buf = regions.ProbeBuffer(args.memory, region)
    dst = buf.host  # None for GPU regions: the baselines need host memory (refused earlier)
    scratch = np.ones(region, dtype=np.uint8) if args.baseline or args.cpu else None
    points = [sweep.Point(b, n) for b in args.block_sizes for n in args.batches]
    fits = [p for p in points if p.total <= region]
    for p in points:
        if p.total > region:
            print(f"pdxfer-probe: skipping {report.fmt_size(p.block_size)} x {p.batch}: "
                  f"{report.fmt_size(p.total)} exceeds the holder region ({report.fmt_size(region)})", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    raw = (sweep.RawSocketBaseline(host, int(hello["raw_port"]))
           if (args.baseline or args.cpu) and "tcp" in kinds else None)
    nixl_base = sweep.nixl_baseline() if args.baseline and "nixl" in kinds else None
    if args.baseline and "nixl" in kinds and nixl_base is None:
        print("pdxfer-probe: raw NIXL baseline unavailable (pdxfer.probe.nixl_baseline missing)", file=sys.stderr)
    live = report.LiveTable(enabled=not args.quiet, total=len(fits) * len(kinds))
    failed = False
    try:
        for kind in kinds:
            t = create_transport(kind, **transport_options(kind, connections=args.tcp_connections))
            try:
                try:
                    t.register([RegisteredRegion(0, buf.ptr, buf.nbytes, buf.device)])
                except TransportError as exc:
                    if buf.device == "cpu":
                        raise
                    print(f"pdxfer-probe: skipping {kind}: {exc}", file=sys.stderr)
                    continue
                meta = bytes.fromhex(server.control_request(addr, {"op": "meta", "kind": kind})["meta"])
                peer = t.connect(meta, timeout=args.timeout)
                for p in fits:
                    iters = args.iters or sweep.auto_iters(p.total, args.target_mib << 20)
                    inter = {}
                    if args.baseline:
                        # Same byte count into one contiguous buffer, interleaved with our reads.
                        inter["memcpy"] = sweep.memcpy_once(scratch[:p.total], dst[:p.total])
                        if kind == "tcp" and raw is not None:
                            view = memoryview(scratch).cast("B")[:p.total]
                            inter["raw_socket"] = lambda v=view: raw.once(v)
                    raw_nixl = (_raw_nixl(p, max(120.0, args.timeout))
                                if args.baseline and kind == "nixl" and nixl_base else None)
                    if raw_nixl is not None:
                        inter["raw_nixl"] = lambda b=raw_nixl: sum(b.once())
                    try:
                        row = sweep.measure_transport(t, peer, p, region, buf.nbytes, iters, args.timeout, inter)
                    finally:
                        if raw_nixl is not None:
                            raw_nixl.close()
                    plan = row.pop("_plan")
                    row["transport"] = args.label or kind
                    row["memory"] = f"{args.memory}<-{hello.get('memory', 'cpu')}"
                    if args.check:
                        seed = int(hello["seed"])
                        row["check"] = (sweep.check_point(t, peer, plan, dst, region, seed, args.timeout)
                                        if dst is not None else
                                        check_device_point(t, peer, plan, buf, region, seed, args.timeout))
                        failed |= row["check"] != "ok"
                    if args.baseline:
                        _baselines(row, kind, p, raw, nixl_base, dst, scratch, iters)
                    if args.cpu:
                        _cpu(row, addr, iters, p.total,
                             lambda: t.read(peer, plan).wait(args.timeout),  # noqa: B023 - used at once
                             raw if kind == "tcp" else None, scratch)
                    rows.append(row)
                    live.row(row)
            finally:
                t.close()
    finally:
        if raw is not None:
            raw.close()
    live.done(rows)
    if not rows and fits and kinds and buf.device != "cpu":
        raise TransportError(f"no transport could register {buf.device} memory here (see the skips above)")
    if failed:
        print("pdxfer-probe: --check found wrong bytes", file=sys.stderr)
    return rows


def check_device_point(t: Any, peer: str, plan: Any, buf: regions.ProbeBuffer, region_size: int, seed: int,
                       timeout: float = 60.0) -> str:
    """:func:`sweep.check_point` for a GPU region: zero it, read once more, copy it to host memory
    and compare every byte with the holder's pattern."""
    buf.zero()
    t.read(peer, plan).wait(timeout)
    bad = mismatches(plan, {0: buf.to_host()}, {0: region_size}, seed)
    return "ok" if not bad else f"FAILED ({len(bad)} runs differ; {bad[0]})"


def _baselines(row: dict, kind: str, p: "sweep.Point", raw, nixl_base, dst: np.ndarray, scratch, iters: int) -> None:
    if kind == "tcp" and raw is not None:
        row["baseline"] = "raw_socket"
        row["baseline_gbps"] = row.pop("raw_socket_gbps")
        row["baseline_interleaved"] = True
    elif kind == "nixl" and "raw_nixl_gbps" in row:
        row["baseline"] = "raw_nixl"
        row["baseline_gbps"] = row.pop("raw_nixl_gbps")
        row["baseline_interleaved"] = True
    elif kind == "nixl" and nixl_base is not None:
        # Measured after the point, not interleaved: on a shared box the load may have changed
        # 5x in between (seen: ratio 0.25 while interleaved runs gave 0.9). Rows say so.
        row["baseline_interleaved"] = False
        try:
            res = nixl_base(p.block_size, p.batch, iters, timeout=120.0)
            row["baseline"] = "raw_nixl"
            row["baseline_gbps"] = float(res["gbps"])
        except Exception as exc:  # noqa: BLE001 - a broken baseline must not lose the measured row
            row["baseline"] = "raw_nixl"
            row["baseline_error"] = repr(exc)
    if row.get("baseline_gbps"):
        row["ratio"] = row["gbps"] / row["baseline_gbps"]


def _raw_nixl(p: "sweep.Point", timeout: float = 120.0) -> Any:
    """A raw NIXL reader to interleave with pdxfer's reads (load swings hit both alike), or None.

    Its holder fills 2 x block x batch random bytes before it answers: 512 MiB took over 30 s
    under a load average of ~15, so the start bound is generous.
    """
    try:
        from pdxfer.probe.nixl_baseline import RawNixlBaseline

        return RawNixlBaseline(p.block_size, p.batch, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - fall back to the separate baseline run
        print(f"pdxfer-probe: interleaved raw NIXL baseline unavailable ({exc!r}); measuring it apart",
              file=sys.stderr)
        return None


def _cpu(row: dict, addr: tuple[str, int], iters: int, nbytes: int, read_once, raw, scratch) -> None:
    """Separate, non-interleaved passes so each CPU figure belongs to one thing only."""
    def holder_cpu() -> float:
        return float(server.control_request(addr, {"op": "cpu"})["cpu"])

    n = max(3, iters // 2)
    row.update(sweep.cpu_pass(read_once, n, nbytes, holder_cpu))
    if raw is not None and scratch is not None:
        view = memoryview(scratch).cast("B")[:nbytes]
        base = sweep.cpu_pass(lambda: raw.once(view), n, nbytes, holder_cpu)
        row["baseline_reader_cpu_s_per_gb"] = base["reader_cpu_s_per_gb"]
        row["baseline_holder_cpu_s_per_gb"] = base["holder_cpu_s_per_gb"]


def main(argv: Sequence[str] | None = None) -> int:
    if "--devices" in (sys.argv[1:] if argv is None else argv):
        from pdxfer.probe import devices  # noqa: PLC0415 - RDMA device report, no sweep

        return devices.main(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    apply_log_level(args.log_level)
    try:
        regions.require(args.memory)
    except regions.MemoryUnavailable as exc:
        print(f"pdxfer-probe: {exc}", file=sys.stderr)
        return 2
    if args.mode == "serve":
        return server.run_server(args.host, args.port, args.region_size, args.transport, args.advertise,
                                 args.memory)
    if args.memory != "cpu" and (args.baseline or args.cpu):
        print(f"pdxfer-probe: --baseline and --cpu measure host-memory baselines; they cannot run with "
              f"--memory {args.memory}", file=sys.stderr)
        return 2
    for name in ("block_sizes", "batches"):
        if isinstance(getattr(args, name), str):
            setattr(args, name, parse_list(getattr(args, name), parse_size if name == "block_sizes" else int))
    proc = None
    try:
        if args.mode == "read":
            peer = args.peer
        else:
            proc, peer = spawn_loopback(args.region_size, args.transport, memory=args.memory)
        rows = run_sweep(args, peer)
    except (ConnectionError, OSError) as exc:
        print(f"pdxfer-probe: cannot reach the holder: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (TransportError, RuntimeError) as exc:
        print(f"pdxfer-probe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        report.plot(rows, args.plot)
    return 1 if any(r.get("check", "ok") != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
