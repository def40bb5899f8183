"""The reader side of the probe: time one (transport, block size, batch) point and its baselines.

Per iteration: *prep* builds the TransferPlan from block offsets (what a connector pays per
request), *post* is ``transport.read`` returning a handle, *tx* is from there to ``wait``
returning. GB/s = bytes / median(post + tx). Baselines run in the same process, right after
the point, on the same byte count: raw socket send/recv into one contiguous buffer (tcp), raw
NIXL with the same descriptors (nixl, when ``pdxfer.probe.nixl_baseline`` exists) and memcpy.
"""

from __future__ import annotations

import importlib
import resource
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pdxfer.common import netio
from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import Transport

_U64 = struct.Struct("<Q")


@dataclass
class Point:
    block_size: int
    batch: int

    @property
    def total(self) -> int:
        return self.block_size * self.batch


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def auto_iters(total: int, target_bytes: int, lo: int = 5, hi: int = 200) -> int:
    """Enough iterations to move ``target_bytes`` (a stable median), bounded both ways."""
    return max(lo, min(hi, -(-target_bytes // max(total, 1))))


def measure_transport(t: Transport, peer: str, pt: Point, region_size: int, local_size: int, iters: int,
                      timeout: float = 60.0, interleave: dict[str, Callable[[], float]] | None = None
                      ) -> dict[str, Any]:
    """Time ``iters`` reads of one scattered plan (plus one untimed warm-up).

    ``interleave`` maps a name to a baseline that moves the same bytes and returns its seconds;
    each runs once after every timed read, so load changes on a shared box hit both alike.
    Their medians come back as ``<name>_gbps``.
    """
    interleave = interleave or {}
    for fn in interleave.values():
        fn()  # warm-up
    template = scattered_plan(pt.block_size, pt.batch, region_size, local_size, seed=pt.block_size + pt.batch)
    offs = [(r.remote_offset, r.local_offset) for r in template.runs]
    bs = pt.block_size

    def build() -> TransferPlan:
        return TransferPlan(tuple(TransferRun(0, ro, 0, lo, bs) for ro, lo in offs), len(offs))

    t.read(peer, build()).wait(timeout)  # warm-up: connection set-up, page faults
    prep, post, tx = [], [], []
    extra: dict[str, list[float]] = {}
    for _ in range(iters):
        t0 = time.perf_counter()
        plan = build()
        t1 = time.perf_counter()
        h = t.read(peer, plan)
        t2 = time.perf_counter()
        h.wait(timeout)
        t3 = time.perf_counter()
        prep.append(t1 - t0)
        post.append(t2 - t1)
        tx.append(t3 - t2)
        for name, fn in interleave.items():
            extra.setdefault(name, []).append(fn())
    xfer = [a + b for a, b in zip(post, tx)]
    us = 1e6
    return {
        **{f"{name}_gbps": pt.total / statistics.median(ts) / 1e9 for name, ts in extra.items()},
        "block_size": pt.block_size, "batch": pt.batch, "bytes": pt.total, "iters": iters,
        "gbps": pt.total / statistics.median(xfer) / 1e9,
        "avg_lat_us": statistics.fmean(p + q + r for p, q, r in zip(prep, post, tx)) * us,
        "prep_avg_us": statistics.fmean(prep) * us, "prep_p99_us": p99(prep) * us,
        "post_avg_us": statistics.fmean(post) * us, "post_p99_us": p99(post) * us,
        "tx_avg_us": statistics.fmean(tx) * us, "tx_p99_us": p99(tx) * us,
        "_plan": template,
    }


def check_point(t: Transport, peer: str, plan: TransferPlan, dst: np.ndarray, region_size: int, seed: int,
                timeout: float = 60.0) -> str:
    """Zero the destination, read once more, compare every byte with the holder's pattern."""
    dst[:] = 0
    t.read(peer, plan).wait(timeout)
    bad = mismatches(plan, {0: dst}, {0: region_size}, seed)
    return "ok" if not bad else f"FAILED ({len(bad)} runs differ; {bad[0]})"


class RawSocketBaseline:
    """Raw socket streaming from the probe server into one contiguous buffer (no framing)."""

    def __init__(self, host: str, port: int, bufsize: int = 4 << 20) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)

    def once(self, view: memoryview) -> float:
        n = len(view)
        t0 = time.perf_counter()
        self.sock.sendall(_U64.pack(n))
        netio.recv_exact_into(self.sock, view, "raw baseline bytes")
        return time.perf_counter() - t0

    def gbps(self, view: memoryview, iters: int) -> float:
        self.once(view)
        return len(view) / statistics.median(self.once(view) for _ in range(iters)) / 1e9

    def close(self) -> None:
        self.sock.close()


def memcpy_once(dst: np.ndarray, src: np.ndarray) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0
    return once


def memcpy_gbps(dst: np.ndarray, src: np.ndarray, nbytes: int, iters: int) -> float:
    """The local copy limit: one contiguous numpy copy of the same byte count."""
    d, s = dst[:nbytes], src[:nbytes]
    np.copyto(d, s)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        np.copyto(d, s)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts) / 1e9


def nixl_baseline() -> Callable[[int, int, int], dict] | None:
    """``raw_nixl_read_gbps`` from ``pdxfer.probe.nixl_baseline`` if it is there and imports."""
    try:
        mod = importlib.import_module("pdxfer.probe.nixl_baseline")
        return getattr(mod, "raw_nixl_read_gbps")
    except Exception:  # noqa: BLE001 - missing or broken: the probe just skips this baseline
        return None


def cpu_pass(once: Callable[[], object], n: int, nbytes: int, holder_cpu: Callable[[], float]) -> dict[str, float]:
    """CPU seconds per GB moved, on this (reader) process and on the holder, over ``n`` calls.

    Unlike GB/s this barely depends on how busy the machine is, so it compares transports
    fairly on a shared box. Run it with nothing else going on in either process.
    """
    def mine() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    h0, c0 = holder_cpu(), mine()
    for _ in range(n):
        once()
    c1, h1 = mine(), holder_cpu()
    gb = n * nbytes / 1e9
    return {"reader_cpu_s_per_gb": (c1 - c0) / gb, "holder_cpu_s_per_gb": (h1 - h0) / gb}
