"""Raw NIXL READ baseline: what NIXL alone achieves with the descriptor shape pdxfer uses.

``raw_nixl_read_gbps(block_size, batch, iters)`` (or ``RawNixlBaseline(...).once()`` to interleave
with pdxfer's own reads) starts a holder in a second process (plain NIXL
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

import numpy as np

from pdxfer.common.procs import close_stdin_and_reap
from pdxfer.transport.nixl.env import load_nixl, prepare_ucx_env

# Before UCX loads, here and in the holder this spawns (else rc 139 at exit, measured with NIXL 1.5).
prepare_ucx_env()

_REPO = Path(__file__).resolve().parents[2]


def _agent(name: str) -> Any:
    api = load_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _fill(buf: np.ndarray, seed: int) -> None:
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.nbytes, dtype=np.uint8)


def hold(size: int, seed: int, poll_s: float, pdxfer: bool = False) -> int:
    """Holder: register, print the metadata, progress the target until stdin closes or SIGTERM.

    With ``pdxfer`` the holder is a pdxfer NixlTransport instead (for ``compare_with_pdxfer``).
    """
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the reader
    except (OSError, AttributeError):
        pass
    buf = np.empty(size, dtype=np.uint8)
    _fill(buf, seed)
    if pdxfer:
        from pdxfer.transport import create_transport
        from pdxfer.transport.base import RegisteredRegion

        with create_transport("nixl") as t:
            t.register([RegisteredRegion(0, buf.ctypes.data, size)])
            print("META", t.metadata().hex(), buf.ctypes.data, flush=True)
            sys.stdin.read()  # its own progress thread serves; wait for the reader to close stdin
        return 0
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


def _start_holder(size: int, seed: int, poll_s: float, timeout: float, pdxfer: bool = False,
                  holder_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, bytes, int]:
    env = dict(os.environ, **(holder_env or {}))
    env["PYTHONPATH"] = str(_REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "pdxfer.probe.nixl_baseline", "hold", str(size),
                             "--seed", str(seed), "--poll-s", str(poll_s)] + (["--pdxfer"] if pdxfer else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            close_stdin_and_reap(proc, 3.0)
            raise TimeoutError(f"raw NIXL holder gave no metadata within {timeout} s")
        line = proc.stdout.readline().decode()
        if not line:
            err = proc.stderr.read().decode() if proc.stderr else ""
            close_stdin_and_reap(proc, 3.0)
            raise RuntimeError(f"raw NIXL holder exited early: {err[-1500:]}")
        if line.startswith("META "):
            _, md, addr = line.split()
            return proc, bytes.fromhex(md), int(addr)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


class RawNixlBaseline:
    """A raw NIXL reader with its own holder process, for interleaving with pdxfer reads.

    ``once()`` performs one READ of ``batch`` scattered ``block_size`` descriptors and returns its
    (prep, post, tx) seconds; pdxfer-probe can call it right after each of its own timed reads so
    that load changes on a shared machine hit both alike (``lambda: sum(b.once())``).
    The first READ (UCX wire-up) happens in the constructor. Use as a context manager or ``close()``.
    """

    def __init__(self, block_size: int, batch: int, seed: int = 0, holder_poll_s: float = 0.0005,
                 timeout: float = 30.0, holder_env: dict[str, str] | None = None):
        if block_size <= 0 or batch <= 0:
            raise ValueError(f"block_size and batch must be positive (got {block_size}, {batch})")
        self.block_size, self.batch, self.seed, self.timeout = block_size, batch, seed, timeout
        self.nblocks = 2 * batch  # room to scatter: each READ takes batch of 2*batch blocks, shuffled both sides
        self.size = self.nblocks * block_size
        self._proc, md, raddr = _start_holder(self.size, seed, holder_poll_s, timeout, holder_env=holder_env)
        self._agent: Any = None
        try:
            self._agent = _agent(f"raw-reader-{os.getpid()}-{time.monotonic_ns()}")
            self.dst = np.empty(self.size, dtype=np.uint8)
            self.dst.fill(0)  # touch every page: first writes into fresh memory are ~10x slower here
            self._reg = self._agent.register_memory([(self.dst.ctypes.data, self.size, 0, "")], "DRAM")
            peer = self._agent.add_remote_agent(md)
            self._peer = peer.decode() if isinstance(peer, bytes) else peer
            # Strided lists: one descriptor per block, like pdxfer's per-peer prepared lists.
            self._rem = self._agent.prep_xfer_dlist(
                self._peer, np.array([[raddr, block_size, 0, block_size, self.nblocks]], np.uint64), "DRAM")
            self._loc = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", np.array([[self.dst.ctypes.data, block_size, 0, block_size, self.nblocks]],
                                            np.uint64), "DRAM")
            rng = np.random.default_rng(seed + 1)
            self.ridx = rng.permutation(self.nblocks)[:batch].astype(np.int32)
            self.lidx = rng.permutation(self.nblocks)[:batch].astype(np.int32)
            self.once()  # wire-up
        except BaseException:
            self.close()
            raise

    def once(self) -> tuple[float, float, float]:
        """One READ: seconds spent in make_prepped_xfer, transfer, and waiting for completion."""
        a = self._agent
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        h = a.make_prepped_xfer("READ", self._loc, self.lidx, self._rem, self.ridx)
        t1 = time.perf_counter()
        st = a.transfer(h)
        t2 = time.perf_counter()
        while st == "PROC":
            if time.monotonic() > deadline:
                h.release()
                raise TimeoutError(f"raw NIXL READ still pending after {self.timeout} s")
            st = a.check_xfer_state(h)
        t3 = time.perf_counter()
        h.release()
        if st != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {st}")
        return t1 - t0, t2 - t1, t3 - t2

    def check(self) -> bool:
        """Every block of the last READ equals the holder's bytes."""
        src = np.empty(self.size, dtype=np.uint8)
        _fill(src, self.seed)
        bs = self.block_size
        return bool(all(np.array_equal(self.dst[li * bs:(li + 1) * bs], src[ri * bs:(ri + 1) * bs])
                        for li, ri in zip(self.lidx.tolist(), self.ridx.tolist())))

    def close(self) -> None:
        a, self._agent = self._agent, None
        if a is not None:
            # release order: prepared lists, remote agent, registered memory, agent
            for step in (lambda: self._rem.release(), lambda: self._loc.release(),
                         lambda: a.remove_remote_agent(self._peer), lambda: a.deregister_memory(self._reg)):
                try:
                    step()
                except Exception:  # noqa: BLE001 - partially constructed: release what exists
                    pass
        if self._proc is not None:
            close_stdin_and_reap(self._proc, 3.0)
            self._proc = None

    def __enter__(self) -> "RawNixlBaseline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_nixl_read_gbps(block_size: int, batch: int, iters: int, check: bool = False, seed: int = 0,
                       holder_poll_s: float = 0.0005, timeout: float = 30.0) -> dict:
    """Raw NIXL READ of ``batch`` scattered ``block_size`` descriptors, ``iters`` times (after one warm-up).

    Returns gbps (bytes / median READ latency / 1e9, as pdxfer-probe computes its rows; ``gbps_mean``
    uses the total time), avg_lat_us per READ, and avg/p99 of prep (make_prepped_xfer), post
    (transfer) and tx (completion wait) in microseconds; with ``check`` every byte of the last READ
    is compared with the holder's pattern (``ok``).
    """
    if iters <= 0:
        raise ValueError(f"iters must be positive (got {iters})")
    with RawNixlBaseline(block_size, batch, seed, holder_poll_s, timeout) as b:
        prep, post, tx = [], [], []
        for _ in range(iters):
            p, q, r = b.once()
            prep.append(p * 1e6)
            post.append(q * 1e6)
            tx.append(r * 1e6)
        ok = b.check() if check else None
    lat = [a + c + d for a, c, d in zip(prep, post, tx)]
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


def compare_with_pdxfer(block_size: int, batch: int, iters: int, seed: int = 0, timeout: float = 30.0,
                        holder_env: dict[str, str] | None = None,
                        variants: dict[str, dict[str, Any]] | None = None) -> dict:
    """pdxfer NIXL and raw NIXL READs of the same scattered blocks, interleaved one by one.

    Each side has its own holder process. pdxfer's time per READ is ``read`` + ``wait`` for a
    freshly built TransferPlan (building the plan objects is not timed, as in pdxfer-probe); raw
    is ``RawNixlBaseline.once``. Returns medians and ``ratio`` = pdxfer / raw GB/s, bytes checked.
    ``holder_env`` is added to both holders' environments (the soft-RoCE ladder puts them on
    another device than the reader with ``UCX_NET_DEVICES``). ``variants`` maps a name to
    NixlTransport options: each is one more pdxfer reader of the same holder, interleaved too,
    reported as ``<name>_gbps`` (e.g. the old sleeping wait, ``{"wait_backoff_s": 0.001}``).
    """
    from contextlib import ExitStack

    from pdxfer.transport.plan import TransferPlan, TransferRun
    from pdxfer.transport import create_transport
    from pdxfer.transport.base import RegisteredRegion

    if iters <= 0:
        raise ValueError(f"iters must be positive (got {iters})")
    names = ["pdxfer", *(variants or {})]
    opts: dict[str, dict[str, Any]] = {"pdxfer": {}, **(variants or {})}
    with RawNixlBaseline(block_size, batch, seed, timeout=timeout, holder_env=holder_env) as raw, ExitStack() as stack:
        proc, md, _ = _start_holder(raw.size, seed, 0.0005, timeout, pdxfer=True, holder_env=holder_env)
        stack.callback(close_stdin_and_reap, proc, 3.0)
        pairs = [(int(r) * block_size, int(l) * block_size) for r, l in zip(raw.ridx, raw.lidx)]

        def plan() -> TransferPlan:
            return TransferPlan(tuple(TransferRun(0, ro, 0, lo, block_size) for ro, lo in pairs), len(pairs))

        sides = {}
        for name in names:
            dst = np.empty(raw.size, dtype=np.uint8)
            dst.fill(0)  # touched, like the raw side's destination
            t = stack.enter_context(create_transport("nixl", **opts[name]))
            t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
            peer = t.connect(md, timeout=timeout)
            t.read(peer, plan()).wait(timeout)  # warm-up, like the raw side's constructor
            sides[name] = (t, peer, dst)
        lat: dict[str, list[float]] = {n: [] for n in names}
        posted: dict[str, list[float]] = {n: [] for n in names}
        base, raw_parts = [], []
        for _ in range(iters):
            for name in names:
                t, peer, _ = sides[name]
                p = plan()
                t0 = time.perf_counter()
                h = t.read(peer, p)
                t1 = time.perf_counter()
                h.wait(timeout)
                lat[name].append(time.perf_counter() - t0)
                posted[name].append(t1 - t0)
                if name == "pdxfer":
                    parts = raw.once()
                    raw_parts.append(parts)
                    base.append(sum(parts))
        src = np.empty(raw.size, dtype=np.uint8)
        _fill(src, seed)
        ok = all(np.array_equal(d[lo:lo + block_size], src[ro:ro + block_size])
                 for _, _, d in sides.values() for ro, lo in pairs)
        ok = ok and raw.check()
    nbytes = block_size * batch
    pg, rg = nbytes / float(np.median(lat["pdxfer"])) / 1e9, nbytes / float(np.median(base)) / 1e9
    out = {"block_size": block_size, "batch": batch, "iters": iters, "pdxfer_gbps": pg, "raw_nixl_gbps": rg,
           "ratio": pg / rg, "pdxfer_avg_lat_us": float(np.mean(lat["pdxfer"])) * 1e6,
           "raw_avg_lat_us": float(np.mean(base)) * 1e6,
           # where each side's time goes: pdxfer read() (checks, indices, make_prepped_xfer, post)
           # vs raw make_prepped_xfer + transfer; the rest is waiting for completion
           "pdxfer_read_avg_us": float(np.mean(posted["pdxfer"])) * 1e6,
           "raw_prep_avg_us": float(np.mean([r[0] for r in raw_parts])) * 1e6,
           "raw_post_avg_us": float(np.mean([r[1] for r in raw_parts])) * 1e6,
           "pdxfer_lat_us": [x * 1e6 for x in lat["pdxfer"]], "raw_lat_us": [x * 1e6 for x in base],
           "ok": bool(ok)}
    for name in names[1:]:
        g = nbytes / float(np.median(lat[name])) / 1e9
        out.update({f"{name}_gbps": g, f"{name}_ratio": g / rg, f"{name}_opts": opts[name],
                    f"{name}_read_avg_us": float(np.mean(posted[name])) * 1e6,
                    f"{name}_lat_us": [x * 1e6 for x in lat[name]]})
    return out


def _variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, _, kvs = spec.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in kvs.split(",") if kv)  # NixlTransport parses strings
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdxfer.probe.nixl_baseline", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    h = sub.add_parser("hold", help="internal: be the holder process")
    h.add_argument("size", type=int)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--poll-s", type=float, default=0.0005)
    h.add_argument("--pdxfer", action="store_true", help="hold with a pdxfer NixlTransport")
    ap.add_argument("--block-size", type=int, default=32 << 10)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--compare", action="store_true", help="interleave pdxfer NIXL reads with the raw ones")
    ap.add_argument("--timeout", type=float, default=30.0, help="bound on holder start-up and on each READ")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V[,K=V]",
                    help="with --compare: one more pdxfer reader with these NixlTransport options (repeatable)")
    ap.add_argument("--holder-env", action="append", default=[], metavar="K=V",
                    help="extra environment for the holder processes (repeatable), e.g. UCX_NET_DEVICES=rxe1:1")
    args = ap.parse_args(argv)
    holder_env = dict(kv.split("=", 1) for kv in args.holder_env)
    if args.mode == "hold":
        return hold(args.size, args.seed, args.poll_s, args.pdxfer)
    if args.compare:
        print(json.dumps(compare_with_pdxfer(args.block_size, args.batch, args.iters, timeout=args.timeout,
                                             holder_env=holder_env, variants=_variants(args.variant))))
        return 0
    print(json.dumps(raw_nixl_read_gbps(args.block_size, args.batch, args.iters, check=args.check,
                                                    timeout=args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
