"""NIXL transport: one NIXL agent with the UCX backend per pdxfer transport.

Memory: CPU tensors register as NIXL ``DRAM``; CUDA tensors as ``VRAM`` with their device id.
The VRAM path has never run on a GPU (none on the development machines); the first VRAM
registration logs which UCX transports will carry it (``vram_paths.py``).

Design decisions (measured on a 2-core host, see docs/nixl.md):
* NIXL's progress thread is off (it costs 2-4x bandwidth on small hosts). The holder side is
  progressed by :class:`~pdxfer.transport.nixl.progress.TargetProgress`, which polls adaptively
  instead of spinning a core.
* ``connect`` wires up eagerly: it loads the peer's NIXL metadata, sends a hello notification
  (which makes the holder's progress thread hot) and READs a random cookie the holder exported.
  A dead or stale peer therefore fails at connect with PeerUnreachable, and the first real READ
  does not pay for the UCX wire-up.
* Descriptor lists are prepared once per (peer, granule), see ``descriptors.py``.
* ``wait`` spins briefly, then sleeps up to ``wait_backoff_s`` (1 ms) between polls; ``0`` polls
  back to back as raw NIXL users do. Over RDMA the reader's polls are what hand UCX's queued work
  requests to the NIC, but measured in the soft-RoCE ladder the back-to-back poll was no faster
  and, on a host with few cores, slower: it takes the core the holder needs (docs/softroce.md).
* Release order on close: in-flight transfer handles, prepared descriptor lists, remote agents,
  registered memory, then the agent.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Sequence

import numpy as np

from pdxfer.transport.plan import TransferPlan
from pdxfer.transport.base import (
    MetadataError,
    OutOfRange,
    PeerDied,
    PeerUnreachable,
    ReadState,
    RegionUnknown,
    RegisteredRegion,
    Transport,
    TransferTimeout,
    TransportError,
)
from pdxfer.transport.nixl import metadata as nixl_meta
from pdxfer.transport.nixl.descriptors import Peer, RegionTable, XferBuilder, mem_of
from pdxfer.transport.nixl.env import load_bindings, load_nixl
from pdxfer.transport.nixl.handle import NixlReadHandle
from pdxfer.transport.nixl.progress import TargetProgress
from pdxfer.transport.nixl.vram_paths import log_once as log_vram_paths
from pdxfer.transport.runs import Run, check_array, check_small_runs, plan_array

log = logging.getLogger(__name__)

_COOKIE_BYTES = 32
_HELLO = b"pdxfer:hello"
_WAKE = b"pdxfer:wake"
_SMALL_PLAN = 8  # plans with at most this many runs skip numpy


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
                 idle_poll_s: float = 0.02, hot_window_s: float = 2.0, wait_backoff_s: float = 0.001):
        # Options may arrive as strings from command lines (peer_proc --opt k=v).
        min_granule, busy_poll_s, idle_poll_s, hot_window_s = (int(min_granule), float(busy_poll_s),
                                                               float(idle_poll_s), float(hot_window_s))
        self._wait_backoff = float(wait_backoff_s)  # 0: wait() polls back to back (see handle.py)
        if isinstance(nixl_progress_thread, str):
            nixl_progress_thread = nixl_progress_thread.lower() in ("1", "true", "yes")
        if min_granule <= 0 or min_granule & (min_granule - 1):
            raise ValueError(f"min_granule must be a positive power of two, got {min_granule}")
        for g in prep_granules:
            if g < min_granule or g & (g - 1):
                raise ValueError(f"prep_granules must be powers of two >= min_granule, got {g}")
        api = self._api = load_nixl()
        self._bind = load_bindings()
        self.name = name or f"pdxfer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        self._reg_dlist: Any = None
        self._xfers = XferBuilder(self._agent, self.name, min_granule)
        self._peers: dict[str, Peer] = {}
        self._inflight: set[NixlReadHandle] = set()
        self._leaked: list[Any] = []
        self._closed = False
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
            mem, dev = mem_of(r.device)
            rows.append((r.index, r.ptr, r.nbytes, mem, dev))
        table = RegionTable.build(rows, "local")
        if not rows:
            return
        if table.mem_type == "VRAM":
            log_vram_paths(self._api)
        with self._lock:
            try:
                self._reg_dlist = self._agent.register_memory([(p, n, d, "") for _, p, n, _, d in rows],
                                                              table.mem_type)
            except self._bind.nixlBackendError as exc:
                devs = sorted({r.device for r in regions})
                raise TransportError(f"NIXL could not register {len(rows)} {table.mem_type} region(s) on {devs}: "
                                     f"{exc} (for VRAM: is the memory really on that GPU, and is UCX built "
                                     "with CUDA? see the NIXL VRAM log lines)") from exc
        self._regions = list(regions)
        self._xfers.local = table
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
            self._xfers.release_local(self._safe)
            if self._reg_dlist is not None:
                self._safe(lambda: self._agent.deregister_memory(self._reg_dlist))
            self._reg_dlist = None
            self._regions = []
            self._xfers.local = RegionTable.build([], "local")

    # ------------------------------------------------------------------ metadata / peers

    def metadata(self) -> bytes:
        self._check_open()
        with self._lock:
            md = self._agent.get_agent_metadata()
        table = self._xfers.local
        regions = tuple(nixl_meta.RemoteRegion(i, int(table.ptr[i]), int(table.nbytes[i]), table.mem_type,
                                               int(table.dev[i])) for i in range(len(table)))
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
            table = RegionTable.build([(r.index, r.ptr, r.nbytes, r.mem_type, r.dev_id) for r in info.regions],
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
            peer = Peer(info.agent, blob, info, table, loopback)
            self._peers[peer.name] = peer
        try:
            self._handshake(peer, timeout)
        except BaseException:
            self.disconnect(peer.name)
            raise
        with self._lock:
            for g in self._prep_granules:
                self._xfers.prepped_for(peer, g)
        return peer.name

    def _handshake(self, peer: Peer, timeout: float) -> None:
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
        rows: list[Run] | None = None
        if len(plan.runs) <= _SMALL_PLAN:
            # A few runs: plain Python is ~5x cheaper than a dozen numpy calls (latency of 1-run reads).
            rows = check_small_runs(plan.runs, p.table.sizes, self._xfers.local.sizes, p.name)
            nbytes = sum(r[4] for r in rows)
        else:
            arr = check_array(plan_array(plan), p.table.sizes, self._xfers.local.sizes, p.name)
            nbytes = int(arr[:, 4].sum())
        if nbytes == 0:  # an empty plan, or only zero-length runs: nothing to post
            return NixlReadHandle(self, peer, None, 0, ReadState.DONE)
        with self._lock:
            if self._closed or peer not in self._peers:
                raise PeerUnreachable(f"NIXL peer {peer!r} was disconnected")
            xfer = None
            try:
                if time.monotonic() - p.last_wake > self._hot_window / 2:
                    # The holder may have gone idle (polling every idle_poll_s): wake it first, so a
                    # READ that needs target progress (UCX over TCP) is not served at the idle rate.
                    self._wake(peer)
                xfer = self._xfers.from_rows(p, rows) if rows is not None else None
                if xfer is None:
                    xfer = self._xfers.from_array(p, arr if rows is None else np.array(rows, dtype=np.int64))
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

    def _release_prepped(self, p: Peer) -> None:
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
        return {**self._xfers.counts, "polls": pg.polls if pg else 0, "notifs": pg.notifs if pg else 0}

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
            self._xfers.release_local(self._safe)
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
        # Dropping the last references destroys the agent (UCX workers, listener) now, not at exit.
        self._agent = self._xfers.agent = None

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # too late for NIXL calls; _close_all already ran at exit
        try:
            self.close()
        except Exception:
            pass
