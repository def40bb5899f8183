"""The CPU stand-in of :class:`pdxfer.device.base.DeviceOps`.

Memory is host memory and the kernels are the CPU ones (:mod:`pdxfer.device.native`). Two modes:

* ``asynchronous=False`` (what a CPU instance of vLLM uses): every operation runs at once on
  the caller's thread and every event is complete when recorded -- no thread, no cost;
* ``asynchronous=True`` (tests): each stream is a FIFO worker thread and ``delay_s`` is slept
  before every operation, so code that uses a copy's result before its event completed reads
  stale bytes here exactly as it would on a GPU, and tests catch it.

Arguments are checked on the caller's thread before anything is enqueued, as the CUDA
implementation does, so a bad run list raises where it was made.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from pdxfer.device import native
from pdxfer.kv.blockgeom import BlockGeometry
from pdxfer.device.base import DeviceError, DeviceEvent, DeviceOps, DeviceStream


class _DoneEvent(DeviceEvent):
    def query(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True


_DONE = _DoneEvent()


class _QueuedEvent(DeviceEvent):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: str | None = None

    def _set(self, error: str | None) -> None:
        self._error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(max(0.0, timeout))

    @property
    def error(self) -> str | None:
        return self._error if self._done.is_set() else None


class CpuStream(DeviceStream):
    """A stream of the stand-in: inline, or one FIFO worker thread."""

    def __init__(self, asynchronous: bool, delay_s: float, name: str) -> None:
        self.handle = 0
        self._delay = delay_s
        self._q: queue.SimpleQueue | None = None
        self._first_error: str | None = None
        if asynchronous:
            self._q = queue.SimpleQueue()
            threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, op: Callable[[], None]) -> None:
        if self._q is None:
            op()
        else:
            self._q.put(op)

    def record(self) -> DeviceEvent:
        if self._q is None:
            return _DONE
        ev = _QueuedEvent()
        self._q.put(ev)
        return ev

    def stop(self) -> None:
        if self._q is not None:
            self._q.put(None)

    def _run(self) -> None:
        assert self._q is not None
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, _QueuedEvent):
                # Like a CUDA event after a failed kernel: the failure is sticky on the stream.
                item._set(self._first_error)
                continue
            if self._delay:
                time.sleep(self._delay)
            try:
                item()
            except Exception as exc:  # reported through the next event, as a device would
                self._first_error = self._first_error or f"{type(exc).__name__}: {exc}"


def _host_flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 1:
        raise DeviceError(f"{name}: the CPU stand-in takes flat uint8 host tensors, got "
                          f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                          f"{getattr(t, 'device', '?')}")
    return t


class CpuStandIn(DeviceOps):
    device = "cpu"
    is_gpu = False

    def __init__(self, *, asynchronous: bool = False, delay_s: float = 0.0) -> None:
        self.asynchronous = asynchronous
        self.delay_s = delay_s
        self._streams: list[CpuStream] = []
        self._lock = threading.Lock()
        self._current = self.new_stream()

    def new_stream(self) -> CpuStream:
        s = CpuStream(self.asynchronous, self.delay_s, f"pdxfer-standin-stream-{len(self._streams)}")
        with self._lock:
            self._streams.append(s)
        return s

    def current_stream(self) -> CpuStream:
        return self._current

    def alloc(self, nbytes: int) -> torch.Tensor:
        if nbytes <= 0:
            raise DeviceError(f"alloc of {nbytes} bytes: must be positive")
        return torch.zeros(int(nbytes), dtype=torch.uint8)

    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        return self.alloc(nbytes)

    def copy(self, dst: torch.Tensor, dst_off: int, src: torch.Tensor, src_off: int, nbytes: int,
             stream: DeviceStream) -> None:
        _host_flat(dst, "dst")
        _host_flat(src, "src")
        for name, off, t in (("src", src_off, src), ("dst", dst_off, dst)):
            if off < 0 or nbytes < 0 or off + nbytes > t.numel():
                raise DeviceError(f"copy of {nbytes} bytes at {name} offset {off} runs outside its "
                                  f"{t.numel()}-byte buffer")
        d, s = dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes]
        self._stream(stream).submit(lambda: d.copy_(s))

    def copy_runs(self, src: torch.Tensor, dst: torch.Tensor, runs: Any, stream: DeviceStream) -> None:
        _host_flat(src, "src")
        _host_flat(dst, "dst")
        arr = np.array(runs, dtype=np.int64, copy=True)
        native.check_copy_runs(src, dst, arr)
        self._stream(stream).submit(lambda: native.copy_runs(src, dst, arr))

    def scatter_tokens(self, src: torch.Tensor, dst: torch.Tensor, src_geom: BlockGeometry,
                       dst_geom: BlockGeometry, runs: Any, stream: DeviceStream,
                       elem_size: int | None = None) -> None:
        _host_flat(src, "src")
        _host_flat(dst, "dst")
        arr = np.array(runs, dtype=np.int64, copy=True)
        native.check_scatter_tokens(src, dst, arr, src_geom, dst_geom, elem_size=elem_size)
        self._stream(stream).submit(
            lambda: native.scatter_tokens(src, dst, arr, src_geom, dst_geom, elem_size=elem_size))

    def record_event(self, stream: DeviceStream) -> DeviceEvent:
        return self._stream(stream).record()

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, []
        for s in streams:
            s.stop()

    def _stream(self, stream: DeviceStream) -> CpuStream:
        if not isinstance(stream, CpuStream):
            raise DeviceError(f"stream {stream!r} is not a stream of the CPU stand-in")
        return stream
