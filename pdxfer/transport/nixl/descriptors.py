"""Descriptor lists of the NIXL transport, as pure functions over region tables and run arrays.

Descriptor lists are prepared once per (peer, granule): one strided NIXL list per side covering
every registered region in ``granule``-byte descriptors. A plan is mapped onto indices of those
lists (a run of n granules is n consecutive indices, which NIXL merges again), so a READ costs one
``make_prepped_xfer``. The granule is the largest power of two dividing every offset and length
of the plan; plans aligned to less than the transport's ``min_granule`` fall back to one
descriptor per run (both cost ~0.2-0.5 ms for 4096 runs here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from pdxfer.transport.base import RegionUnknown, TransportError
from pdxfer.transport.nixl.metadata import NixlPeerInfo
from pdxfer.transport.runs import Run

MAX_GRANULE = 64 << 20  # bigger granules: fewer indices per READ; lists are strided, so cheap
SMALL_INDICES = 4096  # a few-run plan maps to lists in plain Python up to this many descriptors
MAX_INDICES = 1 << 21  # above this many prepared descriptors per READ, one descriptor per run is cheaper


def mem_of(device: object) -> tuple[str, int]:
    """NIXL memory type and device id for a torch device (or its string): ``cpu`` -> DRAM 0,
    ``cuda:N`` -> VRAM N.

    NIXL's UCX backend checks a VRAM registration against the CUDA device that owns the pointer,
    so the id must be the process-visible ordinal torch uses (``tensor.device.index``). A bare
    ``cuda`` names whatever device is current, which this module cannot know: it is refused.
    """
    dev = str(device).strip()
    if dev == "cpu":
        return "DRAM", 0
    kind, sep, index = dev.partition(":")
    if kind == "cuda":
        if not sep:
            raise TransportError(f"NIXL transport needs a device index for GPU memory: got {device!r}, "
                                 "expected cuda:N (str(tensor.device) of a CUDA tensor)")
        if not index.isdigit():
            raise TransportError(f"NIXL transport cannot parse the device index of {device!r}: "
                                 "expected cuda:N with N a non-negative integer")
        # Registration of real GPU memory has never run here (no GPU on the development machines).
        return "VRAM", int(index)
    raise TransportError(f"NIXL transport cannot register memory on device {device!r} (cpu or cuda:N only)")


@dataclass
class RegionTable:
    """Registered regions of one side, as arrays for vectorised range checks."""

    ptr: np.ndarray
    nbytes: np.ndarray
    dev: np.ndarray
    mem_type: str

    @classmethod
    def build(cls, regions: Sequence[tuple[int, int, int, str, int]], side: str) -> "RegionTable":
        # regions: (index, ptr, nbytes, mem_type, dev); index i must be at position i
        for pos, r in enumerate(regions):
            if r[0] != pos:
                raise RegionUnknown(f"{side} region table is not 0..n-1: position {pos} holds index {r[0]}")
        mems = {r[3] for r in regions}
        if len(mems) > 1:
            raise TransportError(f"{side} regions mix memory types {sorted(mems)}; one transport serves one kind")
        return cls(np.array([r[1] for r in regions], dtype=np.uint64),
                   np.array([r[2] for r in regions], dtype=np.int64),
                   np.array([r[4] for r in regions], dtype=np.uint64),
                   mems.pop() if mems else "DRAM")

    def __post_init__(self) -> None:
        self.sizes: list[int] = self.nbytes.tolist()  # Python ints for the few-runs fast path

    def __len__(self) -> int:
        return len(self.nbytes)

    def strided_rows(self, granule: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows (addr, len, dev, stride, count) for one strided NIXL list, and each region's first index."""
        counts = self.nbytes // granule
        rows = np.stack([self.ptr, np.full(len(self), granule, np.uint64), self.dev,
                         np.full(len(self), granule, np.uint64), counts.astype(np.uint64)], axis=1)
        base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        keep = counts > 0  # NIXL rejects zero-count rows; those regions cannot use this granule anyway
        return rows[keep], base


@dataclass
class Prepped:
    local: Any
    remote: Any
    local_base: np.ndarray
    remote_base: np.ndarray

    def __post_init__(self) -> None:
        self.local_base_list = self.local_base.tolist()
        self.remote_base_list = self.remote_base.tolist()


def granule_of(rows: Sequence[Run]) -> int:
    """Largest power of two (at most MAX_GRANULE) dividing every offset and length of the runs."""
    g = 0
    for _, ro, _, lo, n in rows:
        g = math.gcd(g, ro, lo, n)
    return min(g & -g, MAX_GRANULE) if g else MAX_GRANULE


def granule_of_array(arr: np.ndarray) -> int:
    """:func:`granule_of` for a run array."""
    g = int(np.gcd.reduce(np.concatenate([arr[:, 1], arr[:, 3], arr[:, 4]])))
    return min(g & -g, MAX_GRANULE) if g else MAX_GRANULE


def small_indices(rows: Sequence[Run], granule: int, pr: Prepped, remote: RegionTable,
                  local: RegionTable) -> tuple[list[int], list[int]] | None:
    """(local, remote) prepared-list indices of a few runs in plain Python; None when a run is not
    covered by the strided lists or the plan maps to more than SMALL_INDICES descriptors."""
    lidx: list[int] = []
    ridx: list[int] = []
    for rr, ro, lr, lo, nbytes in rows:
        n = nbytes // granule
        # strided lists cover nbytes // granule whole granules; a shorter tail is not in them
        if (ro + nbytes > remote.sizes[rr] // granule * granule
                or lo + nbytes > local.sizes[lr] // granule * granule or len(lidx) + n > SMALL_INDICES):
            return None
        r0 = pr.remote_base_list[rr] + ro // granule
        l0 = pr.local_base_list[lr] + lo // granule
        ridx.extend(range(r0, r0 + n))
        lidx.extend(range(l0, l0 + n))
    return lidx, ridx


def fits(arr: np.ndarray, granule: int, remote: RegionTable, local: RegionTable) -> bool:
    """True when every run lies inside the whole granules the strided lists cover."""
    return bool(np.all(arr[:, 1] + arr[:, 4] <= (remote.nbytes[arr[:, 0]] // granule) * granule)
                and np.all(arr[:, 3] + arr[:, 4] <= (local.nbytes[arr[:, 2]] // granule) * granule))


def array_indices(arr: np.ndarray, granule: int, pr: Prepped) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) int32 prepared-list indices of a run array (runs must pass :func:`fits`)."""
    n = arr[:, 4] // granule
    total = int(n.sum())
    # run i covers n_i consecutive descriptors starting at its first granule
    first = np.cumsum(n) - n
    step = np.arange(total, dtype=np.int64) - np.repeat(first, n)
    ridx = (np.repeat(pr.remote_base[arr[:, 0]] + arr[:, 1] // granule, n) + step).astype(np.int32)
    lidx = (np.repeat(pr.local_base[arr[:, 2]] + arr[:, 3] // granule, n) + step).astype(np.int32)
    return lidx, ridx


def per_run_descs(arr: np.ndarray, remote: RegionTable, local: RegionTable) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor rows (addr, len, dev), one per run: the fallback for small granules."""
    ldesc = np.stack([local.ptr[arr[:, 2]] + arr[:, 3].astype(np.uint64), arr[:, 4].astype(np.uint64),
                      local.dev[arr[:, 2]]], axis=1)
    rdesc = np.stack([remote.ptr[arr[:, 0]] + arr[:, 1].astype(np.uint64), arr[:, 4].astype(np.uint64),
                      remote.dev[arr[:, 0]]], axis=1)
    return ldesc, rdesc


@dataclass
class Peer:
    """A connected NIXL peer: its region table and the lists prepared for it, per granule."""

    name: str
    blob: bytes
    info: NixlPeerInfo
    table: RegionTable
    loopback: bool
    prepped: dict[int, Prepped] = field(default_factory=dict)
    reads: int = 0
    last_wake: float = 0.0  # monotonic time of the last wake-up notification sent to this peer


class XferBuilder:
    """Turns checked runs into one NIXL transfer: prepared strided lists when the plan aligns to
    ``min_granule``, else one descriptor per run. Owns this side's region table and its prepared
    lists (one per granule), and counts which path reads took. Callers hold the agent lock."""

    def __init__(self, agent: Any, own_name: str, min_granule: int) -> None:
        self.agent = agent
        self.own_name = own_name
        self.min_granule = min_granule
        self.local = RegionTable.build([], "local")
        self._local_prepped: dict[int, tuple[Any, np.ndarray]] = {}
        self.counts = {"prepped_reads": 0, "fallback_reads": 0, "prepped_dlists": 0}

    def _target(self, p: Peer) -> str:
        return self.own_name if p.loopback else p.name

    def prepped_for(self, p: Peer, granule: int) -> Prepped | None:
        """Prepared (local, remote) strided lists for a granule, built once per peer; None if impossible."""
        pr = p.prepped.get(granule)
        if pr is not None:
            return pr
        if not len(p.table) or not len(self.local):
            return None
        if int((p.table.nbytes // granule).sum()) >= 2**31 or int((self.local.nbytes // granule).sum()) >= 2**31:
            return None  # NIXL indices are int32
        loc = self._local_prepped.get(granule)
        if loc is None:
            rows, base = self.local.strided_rows(granule)
            if not len(rows):
                return None
            loc = (self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.local.mem_type), base)
            self._local_prepped[granule] = loc
        rows, rbase = p.table.strided_rows(granule)
        if not len(rows):
            return None
        remote = self.agent.prep_xfer_dlist(self._target(p), rows, p.table.mem_type)
        pr = Prepped(loc[0], remote, loc[1], rbase)
        p.prepped[granule] = pr
        self.counts["prepped_dlists"] += 1
        return pr

    def from_rows(self, p: Peer, rows: Sequence[Run]) -> Any:
        """Prepared-list transfer for a few runs built with Python lists; None when the array path must decide."""
        granule = granule_of(rows)
        pr = self.prepped_for(p, granule) if granule >= self.min_granule else None
        idx = small_indices(rows, granule, pr, p.table, self.local) if pr is not None else None
        if idx is None:
            return None
        xfer = self.agent.make_prepped_xfer("READ", pr.local, idx[0], pr.remote, idx[1])
        self.counts["prepped_reads"] += 1
        return xfer

    def from_array(self, p: Peer, arr: np.ndarray) -> Any:
        granule = granule_of_array(arr)
        if granule >= self.min_granule:
            total = int((arr[:, 4] // granule).sum())
            pr = self.prepped_for(p, granule) if total <= MAX_INDICES else None
            if pr is not None and fits(arr, granule, p.table, self.local):
                lidx, ridx = array_indices(arr, granule, pr)
                xfer = self.agent.make_prepped_xfer("READ", pr.local, lidx, pr.remote, ridx)
                self.counts["prepped_reads"] += 1
                return xfer
        # Fallback: plans aligned to less than min_granule: one descriptor per run.
        ldesc, rdesc = per_run_descs(arr, p.table, self.local)
        xfer = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(ldesc, self.local.mem_type),
                                          self.agent.get_xfer_descs(rdesc, p.table.mem_type), self._target(p))
        self.counts["fallback_reads"] += 1
        return xfer

    def release_local(self, safe: Callable[[Callable[[], Any]], None]) -> None:
        """Release this side's prepared lists (each through ``safe``, which logs a failing step)."""
        for dl, _ in self._local_prepped.values():
            safe(dl.release)
        self._local_prepped.clear()
