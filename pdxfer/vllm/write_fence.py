"""The write fence: how a holder's scheduler learns that the KV writes of a step have completed
on the device before it publishes the blocks those writes filled.

The scheduler numbers every step it builds (``PdxferConnectorMetadata.step_seq``). Each worker
records a device event at the point where all of the step's KV writes are enqueued and, once the
event completed, stores that number in its rank's slot of a small shared-memory segment
(:class:`WriteFence`) the scheduler created. The scheduler publishes a finished request only once
every rank's slot reached the last step that wrote into the request's blocks.

Seeing a request finish says nothing about the device: with asynchronous scheduling vLLM builds
step N+1 before step N's output is processed, and an abort arrives while the step is in flight.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import struct
import sys
import threading
import time
from collections import deque
from multiprocessing import shared_memory

from pdxfer.device.base import DeviceEvent, DeviceOps

log = logging.getLogger("pdxfer.vllm.fence")

_MAGIC = 0x46584450  # "PDXF"
_VERSION = 1
_HEADER = struct.Struct("<III4x")  # magic, version, tp_size
_SLOT = struct.Struct("<QQ")  # completed step seq, and its complement (a torn slot reads as "not yet")
_MASK = (1 << 64) - 1
# The longest single sleep while polling the slots: the publisher thread waits off the step path,
# so a millisecond or a few of added publish latency is all polling costs.
_POLL_MAX_S = 0.002
# How long the worker's thread blocks on one event before it looks at whether it is closing.
_EVENT_SLICE_S = 0.5

# Segments this process created, by name: a worker in the same process (vLLM's in-process
# executor, tests) uses the creator's mapping instead of registering the name a second time.
_created: dict[str, "WriteFence"] = {}
_created_lock = threading.Lock()


class WriteFenceError(RuntimeError):
    """A fence segment that is missing, foreign or too small for the rank that writes to it."""


def fence_name(engine_id: str) -> str:
    """A new segment name for ``engine_id``: short (macOS allows 31 bytes), and unique per
    scheduler process, so a stale segment of an earlier run with the same engine id, whose slots
    hold that run's step numbers, is never mistaken for this one."""
    digest = hashlib.blake2s(engine_id.encode(), digest_size=4).hexdigest()
    return f"pdxf-{digest}-{secrets.token_hex(4)}"


class WriteFence:
    """One slot per TP rank: the newest step whose KV writes that rank saw complete."""

    def __init__(self, shm: shared_memory.SharedMemory, tp_size: int, *, owner: bool,
                 borrowed: bool = False) -> None:
        self._shm = shm
        self.name = shm.name.lstrip("/")
        self.tp_size = tp_size
        self._owner = owner
        self._borrowed = borrowed  # the creator's mapping, in the creator's process: its to close
        self._closed = False

    @classmethod
    def create(cls, engine_id: str, tp_size: int) -> "WriteFence":
        """The scheduler's segment (it unlinks it at :meth:`close`); every slot starts at 0."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        shm = shared_memory.SharedMemory(name=fence_name(engine_id), create=True,
                                         size=_HEADER.size + tp_size * _SLOT.size)
        for r in range(tp_size):
            _SLOT.pack_into(shm.buf, _HEADER.size + r * _SLOT.size, 0, _MASK)
        _HEADER.pack_into(shm.buf, 0, _MAGIC, _VERSION, tp_size)  # last: a reader sees it only complete
        fence = cls(shm, tp_size, owner=True)
        with _created_lock:
            _created[fence.name] = fence
        return fence

    @classmethod
    def attach(cls, name: str) -> "WriteFence":
        """A worker's view of the scheduler's segment ``name``."""
        with _created_lock:
            mine = _created.get(name)
        if mine is not None:
            return cls(mine._shm, mine.tp_size, owner=False, borrowed=True)
        try:
            if sys.version_info >= (3, 13):
                shm = shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
            else:
                # Registers the name with the resource tracker again. A worker started by
                # multiprocessing shares the scheduler's tracker (a set of names: no change);
                # one with a tracker of its own has it unlink the name when the worker exits,
                # which the scheduler's mapping survives.
                shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError as exc:
            raise WriteFenceError(f"write fence {name!r} does not exist (its scheduler is gone?)") from exc
        if shm.size < _HEADER.size:
            shm.close()
            raise WriteFenceError(f"write fence {name!r} is {shm.size} bytes, not a pdxfer fence")
        magic, version, tp_size = _HEADER.unpack_from(shm.buf, 0)
        if magic != _MAGIC or version != _VERSION or shm.size < _HEADER.size + tp_size * _SLOT.size:
            shm.close()
            raise WriteFenceError(f"write fence {name!r} has magic {magic:#x} version {version}: not a "
                                  f"pdxfer fence of version {_VERSION}")
        return cls(shm, tp_size, owner=False)

    # ------------------------------------------------------------------ worker

    def store(self, rank: int, seq: int) -> None:
        """Rank ``rank`` saw the KV writes of every step up to ``seq`` complete."""
        if not 0 <= rank < self.tp_size:
            raise WriteFenceError(f"write fence {self.name} has {self.tp_size} rank slots, rank {rank} wrote")
        buf = self._shm.buf
        if buf is None:  # the creator in this process closed it first (shutdown): nobody reads it
            return
        _SLOT.pack_into(buf, _HEADER.size + rank * _SLOT.size, seq, seq ^ _MASK)

    # ------------------------------------------------------------------ scheduler

    def slots(self) -> list[int]:
        """Per rank, the newest step it saw complete (0: none yet, or caught mid-write: the
        next poll reads it again)."""
        buf = self._shm.buf
        if buf is None:  # closed (shutdown): nothing completes any more
            return [0] * self.tp_size
        out = []
        for r in range(self.tp_size):
            seq, check = _SLOT.unpack_from(buf, _HEADER.size + r * _SLOT.size)
            out.append(seq if seq ^ check == _MASK else 0)
        return out

    def completed(self) -> int:
        """The newest step every rank saw complete (0: none yet)."""
        return min(self.slots())

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Block at most ``timeout`` seconds until :meth:`completed` reaches ``seq``."""
        if self.completed() >= seq:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        nap = 0.0001
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.completed() >= seq
            time.sleep(min(nap, left))
            nap = min(nap * 2, _POLL_MAX_S)
            if self.completed() >= seq:
                return True

    def close(self) -> None:
        """Unmap; the creator also removes the name (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._borrowed:
            return
        if not self._owner:
            self._shm.close()
            return
        with _created_lock:
            _created.pop(self.name, None)
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:  # a worker's own resource tracker unlinked it at its exit
            pass


class FenceWriter:
    """A worker rank's half: per step, an event on the compute stream; a thread of its own
    stores the step's number once the event completed, so an idle engine's last step completes
    the fence without any further step.

    When the event has completed at record (the synchronous CPU stand-in) the number is stored
    inline and no thread is ever started."""

    def __init__(self, rank: int, ops: DeviceOps | None = None, *, device: str | None = None) -> None:
        """``ops``: the operations of the KV's device; or ``device``, resolved at the first step
        that needs a fence (an instance that holds nothing never loads them)."""
        self.rank = rank
        self._ops = ops  # None: no device operations for this KV (stored at once, as before fences)
        self._device = device if ops is None else None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[tuple[WriteFence, int, DeviceEvent]] = deque()
        self._stored: dict[str, int] = {}
        self._fence: WriteFence | None = None
        self._attach_failed: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._failed_reported = False

    def step_enqueued(self, fence: str, step_seq: int) -> None:
        """Every KV write of step ``step_seq`` is enqueued on the current stream (vLLM's
        ``wait_for_save``). ``fence``: the scheduler's segment name ("": the scheduler holds
        nothing, so nothing waits for this step)."""
        if not fence or step_seq <= 0:
            return
        f = self._fence_for(fence)
        if f is None:
            return
        if self._device is not None:
            self._ops, self._device = device_ops_or_none(self._device), None
        if self._ops is None:
            self._store(f, step_seq)
            return
        try:
            ev = self._ops.record_event(self._ops.current_stream())
        except Exception as exc:  # never fail vLLM's step; the stalled fence drops the publishes
            self._report_failure(step_seq, f"recording its event failed: {exc}")
            return
        with self._lock:
            if not self._pending and ev.query() and ev.error is None:
                self._store_locked(f, step_seq)
                return
            self._pending.append((f, step_seq, ev))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"pdxfer-fence-r{self.rank}", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _fence_for(self, name: str) -> WriteFence | None:
        if self._fence is not None and self._fence.name == name:
            return self._fence
        if name in self._attach_failed:
            return None
        try:
            f = WriteFence.attach(name)
            if self.rank >= f.tp_size:
                f.close()
                raise WriteFenceError(f"write fence {name} has {f.tp_size} rank slots, this is rank {self.rank}")
        except (WriteFenceError, OSError) as exc:
            # The scheduler then never sees this rank's steps complete and drops its publishes
            # (each with a warning there): safe, and loud.
            self._attach_failed.add(name)
            log.error("pdxfer: TP rank %d cannot open the write fence: %s; its scheduler will not "
                      "publish any KV", self.rank, exc)
            return None
        old, self._fence = self._fence, f
        if old is not None:
            old.close()
        return f

    def _store(self, f: WriteFence, seq: int) -> None:
        with self._lock:
            self._store_locked(f, seq)

    def _store_locked(self, f: WriteFence, seq: int) -> None:
        # Never backwards: the thread may still store an older step that completed meanwhile.
        if seq > self._stored.get(f.name, 0):
            self._stored[f.name] = seq
            f.store(self.rank, seq)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._wake.wait(_EVENT_SLICE_S)
                if self._closing:
                    return
                f, seq, ev = self._pending[0]
            # Events of one stream complete in order: the head is the next to complete.
            while not ev.wait(_EVENT_SLICE_S):
                if self._closing:
                    return
            with self._lock:
                self._pending.popleft()
                if ev.error is not None:
                    # The step's work failed: its KV may be garbage, so the fence stays where it
                    # is and the scheduler drops the publishes waiting on it.
                    self._report_failure(seq, ev.error)
                    continue
                self._store_locked(f, seq)

    def _report_failure(self, seq: int, why: str) -> None:
        if not self._failed_reported:  # once: every later step of a failed device fails alike
            self._failed_reported = True
            log.error("pdxfer: TP rank %d: step %d: %s; KV written from then on is not published",
                      self.rank, seq, why)

    def close(self, timeout: float = 2.0) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        with self._lock:  # a thread that outlived the join stores under this lock: not mid-close
            if self._fence is not None:
                self._fence.close()
                self._fence = None


def device_ops_or_none(device: str) -> DeviceOps | None:
    """The device operations for KV on ``device``, or None (logged) when there are none here."""
    from pdxfer.device import DeviceError, device_ops_for

    try:
        return device_ops_for(device)
    except (DeviceError, ImportError) as exc:
        log.warning("pdxfer: no device operations for %s (%s): blocks are published without waiting "
                    "for their KV writes to complete on the device", device, exc)
        return None


__all__ = ["FenceWriter", "WriteFence", "WriteFenceError", "device_ops_or_none", "fence_name"]
