"""Raw NIXL READ baseline: what NIXL alone achieves with the descriptor shape pdxfer uses.

``raw_nixl_read_gbps(block_size, batch, iters)`` starts a holder in a second process (plain NIXL
agent, one registered buffer, progress thread off, target progressed by a light poll loop), then in
this process reads ``batch`` scattered ``block_size`` descriptors per iteration the way a NIXL user
such as vLLM's NixlConnector does: strided descriptor lists prepared once, then per iteration one
``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` to completion + release.
No pdxfer transport code is on the measured path; the probe reports pdxfer NIXL against this.

Run as a module, ``python -m pdxfer.probe.nixl_baseline --block-size 32768 --batch 4096``, to print
one measurement, or ``... hold SIZE`` (internal) to be the holder.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
    os.environ.setdefault("UCX_MODULES", "^ib")  # before UCX loads: else rc 139 at exit (PLATFORM.md)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

_REPO = Path(__file__).resolve().parents[2]


def _api() -> Any:
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            return __import__(f"{name}._api", fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise ImportError("NIXL is not installed (pip install nixl-cu12==1.5.1)")


def _agent(name: str) -> Any:
    api = _api()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _fill(buf: np.ndarray, seed: int) -> None:
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.nbytes, dtype=np.uint8)


def hold(size: int, seed: int, poll_s: float) -> int:
    """Holder: register, print the metadata, progress the target until stdin closes or SIGTERM."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the reader
    except (OSError, AttributeError):
        pass
    buf = np.empty(size, dtype=np.uint8)
    _fill(buf, seed)
    agent = _agent(f"raw-holder-{os.getpid()}")
    reg = agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    print("META", agent.get_agent_metadata().hex(), buf.ctypes.data, flush=True)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        agent.get_new_notifs()  # target progress: UCX wire-up (and TCP-emulated READs) need it
        if select.select([sys.stdin], [], [], poll_s)[0] and not sys.stdin.read(1):
            break  # reader closed our stdin: done
    agent.deregister_memory(reg)
    return 0


def _start_holder(size: int, seed: int, poll_s: float, timeout: float) -> tuple[subprocess.Popen, bytes, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "pdxfer.probe.nixl_baseline", "hold", str(size),
                             "--seed", str(seed), "--poll-s", str(poll_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            _stop(proc)
            raise TimeoutError(f"raw NIXL holder gave no metadata within {timeout} s")
        line = proc.stdout.readline().decode()
        if not line:
            err = proc.stderr.read().decode() if proc.stderr else ""
            _stop(proc)
            raise RuntimeError(f"raw NIXL holder exited early: {err[-1500:]}")
        if line.startswith("META "):
            _, md, addr = line.split()
            return proc, bytes.fromhex(md), int(addr)


def _stop(proc: subprocess.Popen) -> None:
    for f in (proc.stdin,):
        try:
            if f:
                f.close()
        except OSError:
            pass
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def raw_nixl_read_gbps(block_size: int, batch: int, iters: int, check: bool = False, seed: int = 0,
                       holder_poll_s: float = 0.0005, timeout: float = 30.0) -> dict:
    """Raw NIXL READ of ``batch`` scattered ``block_size`` descriptors, ``iters`` times (after one warm-up).

    Returns gbps (bytes / median READ latency / 1e9, as pdxfer-probe computes its rows; ``gbps_mean``
    uses the total time), avg_lat_us per READ, and avg/p99 of
    prep (make_prepped_xfer), post (transfer) and tx (completion wait) in microseconds; with
    ``check`` every byte of the last READ is compared with the holder's pattern (``ok``).
    """
    if block_size <= 0 or batch <= 0 or iters <= 0:
        raise ValueError(f"block_size, batch and iters must be positive (got {block_size}, {batch}, {iters})")
    nblocks = 2 * batch  # room to scatter: every READ picks batch of 2*batch blocks, shuffled both sides
    size = nblocks * block_size
    proc, md, raddr = _start_holder(size, seed, holder_poll_s, timeout)
    agent = None
    try:
        agent = _agent(f"raw-reader-{os.getpid()}-{time.monotonic_ns()}")
        dst = np.zeros(size, dtype=np.uint8)
        reg = agent.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
        peer = agent.add_remote_agent(md)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        # Strided lists: one descriptor per block, like pdxfer's per-peer prepared lists.
        rem = agent.prep_xfer_dlist(peer, np.array([[raddr, block_size, 0, block_size, nblocks]], np.uint64), "DRAM")
        loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                    np.array([[dst.ctypes.data, block_size, 0, block_size, nblocks]], np.uint64),
                                    "DRAM")
        rng = np.random.default_rng(seed + 1)
        ridx = rng.permutation(nblocks)[:batch].astype(np.int32)
        lidx = rng.permutation(nblocks)[:batch].astype(np.int32)
        prep, post, tx, lat = [], [], [], []
        deadline = time.monotonic() + timeout
        for it in range(iters + 1):
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", loc, lidx, rem, ridx)
            t1 = time.perf_counter()
            st = agent.transfer(h)
            t2 = time.perf_counter()
            while st == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw NIXL READ still pending after {timeout} s")
                st = agent.check_xfer_state(h)
            t3 = time.perf_counter()
            if st != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in state {st}")
            h.release()
            if it:  # iteration 0 pays the UCX wire-up
                prep.append((t1 - t0) * 1e6)
                post.append((t2 - t1) * 1e6)
                tx.append((t3 - t2) * 1e6)
                lat.append((t3 - t0) * 1e6)
        ok = None
        if check:
            src = np.empty(size, dtype=np.uint8)
            _fill(src, seed)
            ok = bool(all(np.array_equal(dst[li * block_size:(li + 1) * block_size],
                                         src[ri * block_size:(ri + 1) * block_size])
                          for li, ri in zip(lidx.tolist(), ridx.tolist())))
        rem.release()
        loc.release()
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        nbytes = block_size * batch
        return {
            "name": "raw-nixl",
            "block_size": block_size,
            "batch": batch,
            "iters": iters,
            # bytes / median READ latency, the statistic pdxfer-probe uses for its own rows
            "gbps": nbytes / (float(np.median(lat)) / 1e6) / 1e9,
            "gbps_mean": nbytes * iters / (sum(lat) / 1e6) / 1e9,
            "avg_lat_us": float(np.mean(lat)),
            "prep_avg_us": float(np.mean(prep)), "prep_p99_us": _pct(prep, 99),
            "post_avg_us": float(np.mean(post)), "post_p99_us": _pct(post, 99),
            "tx_avg_us": float(np.mean(tx)), "tx_p99_us": _pct(tx, 99),
            "ok": ok,
        }
    finally:
        agent = None
        _stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdxfer.probe.nixl_baseline", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    h = sub.add_parser("hold", help="internal: be the holder process")
    h.add_argument("size", type=int)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--poll-s", type=float, default=0.0005)
    ap.add_argument("--block-size", type=int, default=32 << 10)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.mode == "hold":
        return hold(args.size, args.seed, args.poll_s)
    print(json.dumps(raw_nixl_read_gbps(args.block_size, args.batch, args.iters, check=args.check)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
