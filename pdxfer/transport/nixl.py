"""NIXL transport: one NIXL agent with the UCX backend per pdxfer transport.

Memory: CPU tensors register as NIXL ``DRAM``; CUDA tensors as ``VRAM`` with their device id.
The VRAM path is written but UNTESTED here (no GPU on the development machines).

Design decisions (measured on a 2-core host, see docs/nixl.md):
* NIXL's progress thread is off (it costs 2-4x bandwidth on small hosts). The holder side is
  progressed by :class:`~pdxfer.transport.nixl_progress.TargetProgress`, which polls adaptively
  instead of spinning a core.
* ``connect`` wires up eagerly: it loads the peer's NIXL metadata, sends a hello notification
  (which makes the holder's progress thread hot) and READs a random cookie the holder exported.
  A dead or stale peer therefore fails at connect with PeerUnreachable, and the first real READ
  does not pay for the UCX wire-up.
* Descriptor lists are prepared once per (peer, granule): one strided NIXL list per side covering
  every registered region in ``granule``-byte descriptors. A plan is mapped onto indices of those
  lists (a run of n granules is n consecutive indices, which NIXL merges again), so a READ costs
  one ``make_prepped_xfer``. The granule is the largest power of two dividing every offset and
  length of the plan; plans that align to less than ``min_granule`` bytes fall back to
  ``initialize_xfer`` with one descriptor per run (both cost ~0.2-0.5 ms for 4096 runs here).
* Release order on close: in-flight transfer handles, prepared descriptor lists, remote agents,
  registered memory, then the agent.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import operator
import os
import secrets
import socket
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pdxfer.layout import TransferPlan
from pdxfer.transport import nixl_meta
from pdxfer.transport.base import (
    MetadataError,
    OutOfRange,
    PeerDied,
    PeerUnreachable,
    ReadHandle,
    ReadState,
    RegionUnknown,
    RegisteredRegion,
    Transport,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from pdxfer.transport.nixl_env import load_bindings, load_nixl
from pdxfer.transport.nixl_progress import TargetProgress

log = logging.getLogger(__name__)

_COOKIE_BYTES = 32
_HELLO = b"pdxfer:hello"
_WAKE = b"pdxfer:wake"
_MAX_GRANULE = 64 << 20  # bigger granules: fewer indices per READ; lists are strided, so cheap
_SMALL_PLAN = 8  # plans with at most this many runs skip numpy
_SMALL_INDICES = 4096  # ... as long as they map to at most this many prepared descriptors
_MAX_INDICES = 1 << 21  # above this many prepared descriptors per READ, one descriptor per run is cheaper


def _mem_of(device: str) -> tuple[str, int]:
    """NIXL memory type and device id for a torch device string."""
    dev = str(device)
    if dev == "cpu":
        return "DRAM", 0
    if dev.startswith("cuda"):
        # UNTESTED: no GPU here. NIXL's UCX plugin lists VRAM; GPUDirect needs a CUDA-enabled UCX.
        return "VRAM", int(dev.split(":", 1)[1]) if ":" in dev else 0
    raise TransportError(f"NIXL transport cannot register memory on device {device!r} (cpu or cuda only)")


_RUN_FIELDS = operator.attrgetter("remote_region", "remote_offset", "local_region", "local_offset", "nbytes")
_last_plan: tuple[Any, np.ndarray] | None = None  # (weakref to plan, its array): re-read plans skip the walk


def _plan_array(plan: TransferPlan) -> np.ndarray:
    """(n, 5) int64: remote_region, remote_offset, local_region, local_offset, nbytes.

    Walking 4096 run objects costs ~1 ms (fromiter is 2x faster than a list of tuples); the array of
    the most recent plan is kept, keyed by the plan's identity, for callers that re-read one plan.
    """
    global _last_plan
    cached = _last_plan
    if cached is not None and cached[0]() is plan:
        return cached[1]
    runs = plan.runs
    arr = np.fromiter(itertools.chain.from_iterable(map(_RUN_FIELDS, runs)), dtype=np.int64,
                      count=5 * len(runs)).reshape(len(runs), 5)
    arr.flags.writeable = False
    try:
        _last_plan = (weakref.ref(plan), arr)
    except TypeError:  # a plan type without weakref support: just do not cache
        pass
    return arr


@dataclass
class _RegionTable:
    """Registered regions of one side, as arrays for vectorised range checks."""

    ptr: np.ndarray
    nbytes: np.ndarray
    dev: np.ndarray
    mem_type: str

    @classmethod
    def build(cls, regions: Sequence[tuple[int, int, int, str, int]], side: str) -> "_RegionTable":
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
class _Prepped:
    local: Any
    remote: Any
    local_base: np.ndarray
    remote_base: np.ndarray

    def __post_init__(self) -> None:
        self.local_base_list = self.local_base.tolist()
        self.remote_base_list = self.remote_base.tolist()


@dataclass
class _Peer:
    name: str
    blob: bytes
    info: nixl_meta.NixlPeerInfo
    table: _RegionTable
    loopback: bool
    prepped: dict[int, _Prepped] = field(default_factory=dict)
    reads: int = 0
    last_wake: float = 0.0  # monotonic time of the last wake-up notification sent to this peer


class NixlReadHandle(ReadHandle):
    def __init__(self, transport: "NixlTransport", peer: str, xfer: Any, nbytes: int,
                 state: ReadState = ReadState.PENDING, error: TransportError | None = None):
        self._t = transport
        self.peer = peer
        self._xfer = xfer
        self.nbytes = nbytes
        self._state = state
        self._error = error

    @property
    def error(self) -> TransportError | None:
        return self._error

    def _finish(self, state: ReadState, error: TransportError | None = None) -> None:
        self._state, self._error = state, error
        xfer, self._xfer = self._xfer, None
        self._t._forget(self)
        if xfer is not None:
            self._t._release_xfer(xfer)

    def poll(self) -> ReadState:
        if self._state is not ReadState.PENDING:
            return self._state
        t = self._t
        try:
            with t._lock:
                if self._xfer is None:  # closed under us
                    return self._state
                st = t._agent.check_xfer_state(self._xfer)
        except t._bind.nixlRemoteDisconnectError as exc:
            self._finish(ReadState.FAILED, PeerDied(f"NIXL peer {self.peer} disconnected during READ: {exc}"))
            return self._state
        except Exception as exc:
            self._finish(ReadState.FAILED, PeerDied(f"NIXL READ from {self.peer} failed: {exc!r}"))
            return self._state
        if st == "DONE":
            self._finish(ReadState.DONE)
        elif st == "ERR":
            self._finish(ReadState.FAILED,
                         PeerDied(f"NIXL READ from {self.peer} failed (ERR): peer died or connection lost"))
        return self._state

    def wait(self, timeout: float) -> ReadState:
        deadline = time.monotonic() + max(0.0, timeout)
        # Spin briefly (CMA and small READs finish within microseconds), then back off so a waiting
        # reader does not burn a core for a long transfer. Polling is what progresses the READ.
        spins, sleep = 0, 0.0
        while self.poll() is ReadState.PENDING:
            now = time.monotonic()
            if now - self._t._last_wake(self.peer) > self._t._hot_window / 2:
                self._t._wake(self.peer)  # a long READ must keep the holder's progress hot
            if now >= deadline:
                raise TransferTimeout(f"NIXL READ of {self.nbytes} bytes from {self.peer} still pending "
                                      f"after {timeout:.3f} s")
            spins += 1
            if spins > 200:
                sleep = min(0.001, max(5e-5, sleep * 2))
                time.sleep(sleep)
        if self._state is ReadState.FAILED:
            assert self._error is not None
            raise self._error
        if self._state is ReadState.CANCELLED:
            raise self._error or TransferCancelled(f"READ from {self.peer} was cancelled")
        return self._state

    def cancel(self) -> None:
        if self._state is ReadState.PENDING:
            self._finish(ReadState.CANCELLED, TransferCancelled(f"READ from {self.peer} was cancelled"))


_live: "weakref.WeakSet[NixlTransport]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # atexit runs before the interpreter freezes daemon threads; a progress thread frozen while
    # holding the agent lock would make a later close (from __del__) wait forever (seen: exit hang).
    for t in list(_live):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - exiting anyway; close the others
            pass


class NixlTransport(Transport):
    """pdxfer transport over a NIXL agent (UCX backend by default)."""

    kind = "nixl"

    def __init__(self, name: str | None = None, backends: Sequence[str] = ("UCX",),
                 nixl_progress_thread: bool = False, min_granule: int = 512,
                 prep_granules: Sequence[int] = (4096,), busy_poll_s: float = 0.0005,
                 idle_poll_s: float = 0.02, hot_window_s: float = 2.0):
        # Options may arrive as strings from command lines (peer_proc --opt k=v).
        min_granule, busy_poll_s, idle_poll_s, hot_window_s = (int(min_granule), float(busy_poll_s),
                                                               float(idle_poll_s), float(hot_window_s))
        if isinstance(nixl_progress_thread, str):
            nixl_progress_thread = nixl_progress_thread.lower() in ("1", "true", "yes")
        if min_granule <= 0 or min_granule & (min_granule - 1):
            raise ValueError(f"min_granule must be a positive power of two, got {min_granule}")
        for g in prep_granules:
            if g < min_granule or g & (g - 1):
                raise ValueError(f"prep_granules must be powers of two >= min_granule, got {g}")
        api = load_nixl()
        self._bind = load_bindings()
        self.name = name or f"pdxfer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._min_granule = min_granule
        self._hot_window = hot_window_s
        self._prep_granules = tuple(prep_granules)
        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        cfg = api.nixl_agent_config(enable_prog_thread=nixl_progress_thread, backends=list(backends),
                                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = api.nixl_agent(self.name, cfg)
        if not self._agent.backends:
            raise TransportError(f"NIXL has none of the backends {list(backends)} "
                                 f"(available plugins: {self._agent.get_plugin_list()})")
        # Scratch: [cookie a reader READs back at connect | landing area for our own cookie READs].
        self._scratch = np.zeros(2 * _COOKIE_BYTES, dtype=np.uint8)
        self._cookie = secrets.token_bytes(_COOKIE_BYTES)
        self._scratch[:_COOKIE_BYTES] = np.frombuffer(self._cookie, dtype=np.uint8)
        self._scratch_ptr = int(self._scratch.ctypes.data)
        self._scratch_reg = self._agent.register_memory(
            [(self._scratch_ptr, self._scratch.nbytes, 0, "")], "DRAM")
        self._regions: list[RegisteredRegion] = []
        self._table = _RegionTable.build([], "local")
        self._reg_dlist: Any = None
        self._local_prepped: dict[int, tuple[Any, np.ndarray]] = {}
        self._peers: dict[str, _Peer] = {}
        self._inflight: set[NixlReadHandle] = set()
        self._leaked: list[Any] = []
        self._closed = False
        self._counts = {"prepped_reads": 0, "fallback_reads": 0, "prepped_dlists": 0}
        self._progress: TargetProgress | None = None
        if not nixl_progress_thread:
            self._progress = TargetProgress(self._agent, self._lock, busy_poll_s, idle_poll_s, hot_window_s,
                                            name=f"nixl-progress-{self.name[-8:]}")
            self._progress.start()
        _live.add(self)

    # ------------------------------------------------------------------ memory

    def register(self, regions: Sequence[RegisteredRegion]) -> None:
        self._check_open()
        if self._regions:
            raise TransportError("regions already registered; call deregister() first")
        rows = []
        for pos, r in enumerate(regions):
            if r.index != pos:
                raise RegionUnknown(f"region at position {pos} has index {r.index}; indices must be 0..n-1")
            if r.nbytes <= 0 or r.ptr <= 0:
                raise OutOfRange(f"region {r.index} has ptr {r.ptr:#x} and size {r.nbytes}: nothing to register")
            mem, dev = _mem_of(r.device)
            rows.append((r.index, r.ptr, r.nbytes, mem, dev))
        table = _RegionTable.build(rows, "local")
        if not rows:
            return
        with self._lock:
            self._reg_dlist = self._agent.register_memory([(p, n, d, "") for _, p, n, _, d in rows], table.mem_type)
        self._regions = list(regions)
        self._table = table
        if self._progress is not None:
            self._progress.poke()

    def deregister(self) -> None:
        if self._closed:
            return
        with self._lock:
            for h in list(self._inflight):
                h.cancel()
            for peer in self._peers.values():
                self._release_prepped(peer)
            for dl, _ in self._local_prepped.values():
                self._safe(dl.release)
            self._local_prepped.clear()
            if self._reg_dlist is not None:
                self._safe(lambda: self._agent.deregister_memory(self._reg_dlist))
            self._reg_dlist = None
            self._regions = []
            self._table = _RegionTable.build([], "local")

    # ------------------------------------------------------------------ metadata / peers

    def metadata(self) -> bytes:
        self._check_open()
        with self._lock:
            md = self._agent.get_agent_metadata()
        regions = tuple(nixl_meta.RemoteRegion(i, int(self._table.ptr[i]), int(self._table.nbytes[i]),
                                               self._table.mem_type, int(self._table.dev[i]))
                        for i in range(len(self._table)))
        if self._progress is not None:
            self._progress.poke()  # a reader is likely to connect soon
        return nixl_meta.encode(nixl_meta.NixlPeerInfo(self.name, socket.gethostname(), os.getpid(), regions,
                                                       self._scratch_ptr, self._cookie, md))

    def connect(self, peer_metadata: bytes, timeout: float = 5.0) -> str:
        self._check_open()
        info = nixl_meta.decode(peer_metadata)
        # One connect at a time: the handshake lands every peer's cookie in the same scratch bytes.
        if not self._connect_lock.acquire(timeout=max(0.0, timeout)):
            raise PeerUnreachable(f"connect to {info.agent}: another connect did not finish within {timeout} s")
        try:
            return self._connect(info, bytes(peer_metadata), timeout)
        finally:
            self._connect_lock.release()

    def _connect(self, info: nixl_meta.NixlPeerInfo, blob: bytes, timeout: float) -> str:
        with self._lock:
            old = self._peers.get(info.agent)
            if old is not None:
                if old.blob == blob:
                    return old.name
                self.disconnect(old.name)  # same agent name, new metadata (re-registered memory)
            table = _RegionTable.build([(r.index, r.ptr, r.nbytes, r.mem_type, r.dev_id) for r in info.regions],
                                       f"peer {info.agent}")
            loopback = info.agent == self.name
            if not loopback:
                try:
                    name = self._agent.add_remote_agent(info.nixl_md)
                    name = name.decode() if isinstance(name, bytes) else str(name)
                except (self._bind.nixlBackendError, self._bind.nixlRemoteDisconnectError) as exc:
                    # well-formed metadata, but UCX could not create an endpoint (peer gone)
                    raise PeerUnreachable(f"cannot reach NIXL peer {info.agent} (host {info.host}, "
                                          f"pid {info.pid}): {exc!r}") from exc
                except Exception as exc:
                    raise MetadataError(f"NIXL rejected the metadata of {info.agent}: {exc!r}") from exc
                if name != info.agent:
                    self._safe(lambda: self._agent.remove_remote_agent(name))
                    raise MetadataError(f"metadata header names agent {info.agent!r} but NIXL part is {name!r}")
            peer = _Peer(info.agent, blob, info, table, loopback)
            self._peers[peer.name] = peer
        try:
            self._handshake(peer, timeout)
        except BaseException:
            self.disconnect(peer.name)
            raise
        with self._lock:
            for g in self._prep_granules:
                self._prepped_for(peer, g)
        return peer.name

    def _handshake(self, peer: _Peer, timeout: float) -> None:
        """Wake the holder and READ its cookie back: proves liveness, fresh metadata, and wires UCX up."""
        deadline = time.monotonic() + timeout
        target = self.name if peer.loopback else peer.name
        landing = self._scratch_ptr + _COOKIE_BYTES
        with self._lock:
            self._scratch[_COOKIE_BYTES:] = 0
            xfer = None
            try:
                if not peer.loopback:
                    self._agent.send_notif(peer.name, _HELLO)
                    peer.last_wake = time.monotonic()
                local = self._agent.get_xfer_descs([(landing, _COOKIE_BYTES, 0)], "DRAM")
                remote = self._agent.get_xfer_descs([(peer.info.cookie_ptr, _COOKIE_BYTES, 0)], "DRAM")
                xfer = self._agent.initialize_xfer("READ", local, remote, target)
                state = self._agent.transfer(xfer)
            except Exception as exc:
                if xfer is not None:
                    self._release_xfer(xfer)
                raise PeerUnreachable(f"cannot reach NIXL peer {peer.name} (host {peer.info.host}, "
                                      f"pid {peer.info.pid}): {exc!r}") from exc
        handle = NixlReadHandle(self, peer.name, xfer, _COOKIE_BYTES)
        with self._lock:
            self._inflight.add(handle)
        if state == "ERR":
            handle._finish(ReadState.FAILED, PeerDied("cookie READ failed"))
        try:
            handle.wait(max(0.0, deadline - time.monotonic()))
        except TransferTimeout as exc:
            handle.cancel()
            raise PeerUnreachable(f"NIXL peer {peer.name} (host {peer.info.host}, pid {peer.info.pid}) did not "
                                  f"answer within {timeout:.1f} s") from exc
        except TransportError as exc:
            raise PeerUnreachable(f"NIXL peer {peer.name} (host {peer.info.host}, pid {peer.info.pid}) "
                                  f"is unreachable: {exc}") from exc
        got = self._scratch[_COOKIE_BYTES:].tobytes()
        if got != peer.info.cookie:
            raise PeerUnreachable(f"NIXL peer {peer.name}: cookie mismatch, metadata is stale "
                                  "(the holder restarted or the address belongs to another process)")

    def disconnect(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is None:
                return
            for h in [h for h in self._inflight if h.peer == peer]:
                h.cancel()
            self._release_prepped(p)
            if not p.loopback and not self._closed:
                self._safe(lambda: self._agent.remove_remote_agent(p.name))

    # ------------------------------------------------------------------ reads

    def read(self, peer: str, plan: TransferPlan) -> NixlReadHandle:
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            raise PeerUnreachable(f"not connected to NIXL peer {peer!r}; call connect() with its metadata first")
        if not plan.runs:
            return NixlReadHandle(self, peer, None, 0, ReadState.DONE)
        runs = plan.runs
        small = len(runs) <= _SMALL_PLAN
        if small:
            # A few runs: plain Python is ~5x cheaper than a dozen numpy calls (latency of 1-run reads).
            g = self._validate_small(p, runs)
            nbytes = sum(r.nbytes for r in runs)
        else:
            arr = _plan_array(plan)
            self._validate(p, arr)
            nbytes = int(arr[:, 4].sum())
        with self._lock:
            if self._closed or peer not in self._peers:
                raise PeerUnreachable(f"NIXL peer {peer!r} was disconnected")
            xfer = None
            try:
                if time.monotonic() - p.last_wake > self._hot_window / 2:
                    # The holder may have gone idle (polling every idle_poll_s): wake it first, so a
                    # READ that needs target progress (UCX over TCP) is not served at the idle rate.
                    self._wake(peer)
                xfer = self._make_xfer_small(p, runs, g) if small else None
                if xfer is None:
                    xfer = self._make_xfer(p, arr if not small else _plan_array(plan))
                state = self._agent.transfer(xfer)
            except Exception as exc:
                if xfer is not None:
                    self._release_xfer(xfer)  # now, not whenever the garbage collector gets to it
                died = isinstance(exc, self._bind.nixlRemoteDisconnectError)
                return NixlReadHandle(self, peer, None, nbytes, ReadState.FAILED,
                                      PeerDied(f"NIXL peer {peer} disconnected: {exc}") if died else
                                      PeerDied(f"posting a NIXL READ from {peer} failed: {exc!r}"))
            p.reads += 1
            handle = NixlReadHandle(self, peer, xfer, nbytes)
            self._inflight.add(handle)
        if state == "ERR":
            handle._finish(ReadState.FAILED, PeerDied(f"NIXL READ from {peer} failed at post (ERR)"))
        elif state == "DONE":
            handle._finish(ReadState.DONE)
        return handle

    def _validate(self, p: _Peer, arr: np.ndarray) -> None:
        """Every run inside registered memory on both sides, else a typed error naming the run."""
        for side, reg_col, off_col, table, who in ((
                "remote", 0, 1, p.table, f"peer {p.name}"), ("local", 2, 3, self._table, "this side")):
            reg = arr[:, reg_col]
            bad = np.flatnonzero((reg < 0) | (reg >= len(table)))
            if bad.size:
                i = int(bad[0])
                raise RegionUnknown(f"run {i}: {side} region {int(reg[i])} is not registered on {who} "
                                    f"({len(table)} regions)")
            off, n = arr[:, off_col], arr[:, 4]
            size = table.nbytes[reg]
            bad = np.flatnonzero((off < 0) | (n <= 0) | (off + n > size))
            if bad.size:
                i = int(bad[0])
                raise OutOfRange(f"run {i}: {side} region {int(reg[i])} bytes [{int(off[i])}, "
                                 f"{int(off[i] + n[i])}) outside its {int(size[i])} registered bytes on {who}")

    def _validate_small(self, p: _Peer, runs: Sequence[Any]) -> int:
        """Same checks and messages as ``_validate`` for a few runs; returns the gcd of offsets and sizes."""
        g = 0
        for i, r in enumerate(runs):
            for side, reg, off, table, who in (("remote", r.remote_region, r.remote_offset, p.table, f"peer {p.name}"),
                                               ("local", r.local_region, r.local_offset, self._table, "this side")):
                if not 0 <= reg < len(table.sizes):
                    raise RegionUnknown(f"run {i}: {side} region {reg} is not registered on {who} "
                                        f"({len(table.sizes)} regions)")
                size = table.sizes[reg]
                if off < 0 or r.nbytes <= 0 or off + r.nbytes > size:
                    raise OutOfRange(f"run {i}: {side} region {reg} bytes [{off}, {off + r.nbytes}) outside "
                                     f"its {size} registered bytes on {who}")
            g = math.gcd(g, r.remote_offset, r.local_offset, r.nbytes)
        return g

    def _make_xfer_small(self, p: _Peer, runs: Sequence[Any], g: int) -> Any:
        """Prepared-list READ for a few runs built with Python lists; None when the numpy path must decide."""
        granule = min(g & -g, _MAX_GRANULE)
        if granule < self._min_granule:
            return None
        pr = self._prepped_for(p, granule)
        if pr is None:
            return None
        lidx: list[int] = []
        ridx: list[int] = []
        for r in runs:
            n = r.nbytes // granule
            rs, ls = p.table.sizes[r.remote_region], self._table.sizes[r.local_region]
            if (r.remote_offset + r.nbytes > rs // granule * granule
                    or r.local_offset + r.nbytes > ls // granule * granule or len(lidx) + n > _SMALL_INDICES):
                return None
            r0 = pr.remote_base_list[r.remote_region] + r.remote_offset // granule
            l0 = pr.local_base_list[r.local_region] + r.local_offset // granule
            ridx.extend(range(r0, r0 + n))
            lidx.extend(range(l0, l0 + n))
        xfer = self._agent.make_prepped_xfer("READ", pr.local, lidx, pr.remote, ridx)
        self._counts["prepped_reads"] += 1
        return xfer

    def _make_xfer(self, p: _Peer, arr: np.ndarray) -> Any:
        offs_and_lens = np.concatenate([arr[:, 1], arr[:, 3], arr[:, 4]])
        g = int(np.gcd.reduce(offs_and_lens))
        granule = min(g & -g, _MAX_GRANULE) if g else _MAX_GRANULE
        if granule >= self._min_granule:
            n = arr[:, 4] // granule
            total = int(n.sum())
            pr = self._prepped_for(p, granule) if total <= _MAX_INDICES else None
            if pr is not None and self._fits(arr, granule, p.table, self._table):
                # run i covers n_i consecutive descriptors starting at its first granule
                first = np.cumsum(n) - n
                step = np.arange(total, dtype=np.int64) - np.repeat(first, n)
                ridx = (np.repeat(pr.remote_base[arr[:, 0]] + arr[:, 1] // granule, n) + step).astype(np.int32)
                lidx = (np.repeat(pr.local_base[arr[:, 2]] + arr[:, 3] // granule, n) + step).astype(np.int32)
                xfer = self._agent.make_prepped_xfer("READ", pr.local, lidx, pr.remote, ridx)
                self._counts["prepped_reads"] += 1
                return xfer
        # Fallback: plans aligned to less than min_granule: one descriptor per run.
        ldesc = np.stack([self._table.ptr[arr[:, 2]] + arr[:, 3].astype(np.uint64), arr[:, 4].astype(np.uint64),
                          self._table.dev[arr[:, 2]]], axis=1)
        rdesc = np.stack([p.table.ptr[arr[:, 0]] + arr[:, 1].astype(np.uint64), arr[:, 4].astype(np.uint64),
                          p.table.dev[arr[:, 0]]], axis=1)
        target = self.name if p.loopback else p.name
        xfer = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(ldesc, self._table.mem_type),
                                           self._agent.get_xfer_descs(rdesc, p.table.mem_type), target)
        self._counts["fallback_reads"] += 1
        return xfer

    @staticmethod
    def _fits(arr: np.ndarray, granule: int, remote: _RegionTable, local: _RegionTable) -> bool:
        # strided lists cover nbytes // granule whole granules; a tail shorter than a granule is not in them
        return bool(np.all(arr[:, 1] + arr[:, 4] <= (remote.nbytes[arr[:, 0]] // granule) * granule)
                    and np.all(arr[:, 3] + arr[:, 4] <= (local.nbytes[arr[:, 2]] // granule) * granule))

    def _prepped_for(self, p: _Peer, granule: int) -> _Prepped | None:
        """Prepared (local, remote) strided lists for a granule, built once per peer; None if impossible."""
        pr = p.prepped.get(granule)
        if pr is not None:
            return pr
        if not len(p.table) or not len(self._table):
            return None
        if int((p.table.nbytes // granule).sum()) >= 2**31 or int((self._table.nbytes // granule).sum()) >= 2**31:
            return None
        loc = self._local_prepped.get(granule)
        if loc is None:
            rows, base = self._table.strided_rows(granule)
            if not len(rows):
                return None
            loc = (self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._table.mem_type), base)
            self._local_prepped[granule] = loc
        rows, rbase = p.table.strided_rows(granule)
        if not len(rows):
            return None
        remote = self._agent.prep_xfer_dlist(self.name if p.loopback else p.name, rows, p.table.mem_type)
        pr = _Prepped(loc[0], remote, loc[1], rbase)
        p.prepped[granule] = pr
        self._counts["prepped_dlists"] += 1
        return pr

    # ------------------------------------------------------------------ lifetime

    def _last_wake(self, peer: str) -> float:
        p = self._peers.get(peer)
        return p.last_wake if p is not None else float("inf")

    def _wake(self, peer: str) -> None:
        """Notify the holder so its progress thread goes hot (best effort: a dead peer fails the READ)."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None or p.loopback or self._closed:
                return
            p.last_wake = time.monotonic()
            try:
                self._agent.send_notif(p.name, _WAKE)
            except Exception as exc:
                log.debug("wake notification to %s failed: %r", peer, exc)

    def _forget(self, handle: NixlReadHandle) -> None:
        with self._lock:
            self._inflight.discard(handle)

    def _release_xfer(self, xfer: Any) -> None:
        try:
            with self._lock:
                xfer.release()
        except Exception as exc:
            # NIXL could not abort an active transfer; retry at close, never crash the caller
            log.debug("deferring release of a NIXL transfer handle: %r", exc)
            self._leaked.append(xfer)

    def _release_prepped(self, p: _Peer) -> None:
        for pr in p.prepped.values():
            self._safe(pr.remote.release)
        p.prepped.clear()

    @staticmethod
    def _safe(fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            log.debug("NIXL cleanup step failed: %r", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"NIXL transport {self.name} is closed")

    @property
    def stats(self) -> dict[str, int]:
        """Which descriptor path reads took, prepared lists built, and target-progress polls/notifications."""
        pg = self._progress
        return {**self._counts, "polls": pg.polls if pg else 0, "notifs": pg.notifs if pg else 0}

    def close(self) -> None:
        if self._closed:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        with self._lock:
            # 1. in-flight transfers  2. prepared lists  3. remote agents  4. registered memory  5. agent
            for h in list(self._inflight):
                h.cancel()
            for xfer in self._leaked:
                self._safe(xfer.release)
            self._leaked.clear()
            peers = list(self._peers.values())
            for p in peers:
                self._release_prepped(p)
            for dl, _ in self._local_prepped.values():
                self._safe(dl.release)
            self._local_prepped.clear()
            for p in peers:
                if not p.loopback:
                    self._safe(lambda: self._agent.remove_remote_agent(p.name))
            self._peers.clear()
            if self._reg_dlist is not None:
                self._safe(lambda: self._agent.deregister_memory(self._reg_dlist))
                self._reg_dlist = None
            self._safe(lambda: self._agent.deregister_memory(self._scratch_reg))
            self._closed = True
            self._regions = []
        # Dropping the last reference destroys the agent (UCX workers, listener) now, not at exit.
        self._agent = None

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # too late for NIXL calls; _close_all already ran at exit
        try:
            self.close()
        except Exception:
            pass
