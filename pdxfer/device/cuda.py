"""CUDA implementation of :class:`pdxfer.device.base.DeviceOps`: torch.cuda streams and events,
``copy_(non_blocking=True)`` copies, and the CUDA twins of the native kernels
(``native/pdx_cuda.cu``, built by ``bash native/build.sh --cuda``) launched through ctypes.

NEVER RUN ON A GPU: the development machines have none. Importing this module works anywhere;
a :class:`CudaDevice` on a machine without CUDA, or a kernel launch without the library, raises
:class:`DeviceError` saying what is missing.

Run lists are checked on the host (:func:`pdxfer.device.native.check_copy_runs` /
:func:`~pdxfer.device.native.check_scatter_tokens`: the kernels do no bounds checks), uploaded to device
memory on the launch's stream and kept referenced until an event recorded after the launch is
seen complete: freeing them earlier would let a queued kernel read reused memory.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
import torch

from pdxfer.device import native
from pdxfer.kv.blockgeom import BlockGeometry
from pdxfer.device.base import DeviceError, DeviceEvent, DeviceOps, DeviceStream
from pdxfer.device.cuda_lib import cuda_library

# Event waits poll query(): a CUDA synchronize cannot be bounded. Short first sleeps keep a
# quick kernel's latency low; the cap keeps a long wait from spinning a core.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3
_RC = {1: "bad argument (PDX_EARG)", 3: "CUDA launch error (PDX_ECUDA; CUDA_LAUNCH_BLOCKING=1 names it)"}


class CudaStream(DeviceStream):
    """A torch.cuda stream; ``handle`` is its ``cudaStream_t``. Objects used by work enqueued
    since the last event stay referenced here until that event takes them."""

    def __init__(self, stream: Any) -> None:
        self.torch = stream
        self.handle = int(stream.cuda_stream)
        self._refs: list[Any] = []
        self._lock = threading.Lock()

    def keep(self, *objs: Any) -> None:
        with self._lock:
            self._refs.extend(objs)

    def take_refs(self) -> list[Any]:
        with self._lock:
            refs, self._refs = self._refs, []
        return refs


class CudaEvent(DeviceEvent):
    """A torch.cuda event recorded on a stream, holding what the work before it uses."""

    def __init__(self, event: Any, refs: list[Any], device: str) -> None:
        self._event = event
        self._refs: list[Any] | None = refs
        self._device = device
        self._error: str | None = None

    def query(self) -> bool:
        if self._refs is None:
            return True
        try:
            done = bool(self._event.query())
        except RuntimeError as exc:  # a failed kernel before the event: CUDA errors are sticky
            self._error = f"{self._device}: {exc}"
            done = True
        if done:
            self._refs = None  # the kernels that read them have completed
        return done

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        pause = _POLL_FIRST_S
        while not self.query():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)
        return True

    @property
    def error(self) -> str | None:
        return self._error


def _cuda_unavailable(index: int) -> str | None:
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no visible GPU"
        return f"cuda:{index}: CUDA is not available to torch ({build}, torch {torch.__version__})"
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        return f"cuda:{index}: no such device ({count} visible)"
    return None


class CudaDevice(DeviceOps):
    is_gpu = True

    def __init__(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise DeviceError(f"CUDA device index must be an int, got {index!r}")
        why = _cuda_unavailable(index)
        if why is not None:
            raise DeviceError(why)
        self.index = index
        self.device = f"cuda:{index}"
        self._torch_device = torch.device("cuda", index)
        self._lib: ctypes.CDLL | None = None
        # One wrapper per cudaStream_t: the references work holds live on the wrapper until an
        # event recorded on that same stream takes them.
        self._wrappers: dict[int, CudaStream] = {}
        self._wrappers_lock = threading.Lock()

    # ------------------------------------------------------------------ streams, events, memory

    def new_stream(self) -> CudaStream:
        return self._wrap(torch.cuda.Stream(device=self._torch_device))

    def current_stream(self) -> CudaStream:
        return self._wrap(torch.cuda.current_stream(self._torch_device))

    def _wrap(self, stream: Any) -> CudaStream:
        with self._wrappers_lock:
            got = self._wrappers.get(int(stream.cuda_stream))
            if got is None:
                got = self._wrappers[int(stream.cuda_stream)] = CudaStream(stream)
            return got

    def alloc(self, nbytes: int) -> torch.Tensor:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise DeviceError(f"alloc of {nbytes!r} bytes on {self.device}: must be a positive int")
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self._torch_device)
        except RuntimeError as exc:
            raise DeviceError(f"alloc of {nbytes} bytes on {self.device} failed: {exc}") from exc

    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise DeviceError(f"pinned alloc of {nbytes!r} bytes: must be a positive int")
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise DeviceError(f"pinned alloc of {nbytes} bytes for {self.device} failed: {exc}") from exc

    def record_event(self, stream: DeviceStream) -> CudaEvent:
        s = self._stream(stream)
        ev = torch.cuda.Event()
        ev.record(s.torch)
        return CudaEvent(ev, s.take_refs(), self.device)

    # ------------------------------------------------------------------ copies

    def copy(self, dst: torch.Tensor, dst_off: int, src: torch.Tensor, src_off: int, nbytes: int,
             stream: DeviceStream) -> None:
        s = self._stream(stream)
        self._flat(dst, "dst", host_ok=True)
        self._flat(src, "src", host_ok=True)
        for name, off, t in (("src", src_off, src), ("dst", dst_off, dst)):
            if off < 0 or nbytes < 0 or off + nbytes > t.numel():
                raise DeviceError(f"copy of {nbytes} bytes at {name} offset {off} runs outside its "
                                  f"{t.numel()}-byte buffer")
        if nbytes == 0:
            return
        d, v = dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes]
        with torch.cuda.stream(s.torch):
            d.copy_(v, non_blocking=True)
        self._hold(s, d, v)

    def copy_runs(self, src: torch.Tensor, dst: torch.Tensor, runs: Any, stream: DeviceStream) -> None:
        s = self._stream(stream)
        self._flat(src, "src")
        self._flat(dst, "dst")
        arr = native.check_copy_runs(src, dst, runs)
        if arr.shape[0] == 0:
            return
        lib = self._library()
        runs_dev = self._upload(arr, s)
        rc = lib.pdx_cuda_copy_runs(src.data_ptr(), dst.data_ptr(), runs_dev.data_ptr(), arr.shape[0], s.handle)
        self._hold(s, src, dst, runs_dev)
        self._check_rc("pdx_cuda_copy_runs", rc)

    def scatter_tokens(self, src: torch.Tensor, dst: torch.Tensor, src_geom: BlockGeometry,
                       dst_geom: BlockGeometry, runs: Any, stream: DeviceStream,
                       elem_size: int | None = None) -> None:
        s = self._stream(stream)
        self._flat(src, "src")
        self._flat(dst, "dst")
        arr, esize = native.check_scatter_tokens(src, dst, runs, src_geom, dst_geom, elem_size=elem_size)
        if arr.shape[0] == 0:
            return
        lib = self._library()
        runs_dev = self._upload(arr, s)
        rc = lib.pdx_cuda_scatter_tokens(src.data_ptr(), dst.data_ptr(), native._geom_struct(src_geom),
                                         native._geom_struct(dst_geom), esize, runs_dev.data_ptr(),
                                         arr.shape[0], s.handle)
        self._hold(s, src, dst, runs_dev)
        self._check_rc("pdx_cuda_scatter_tokens", rc)

    # ------------------------------------------------------------------ helpers

    def _library(self) -> ctypes.CDLL:
        if self._lib is None:
            self._lib = cuda_library()
        return self._lib

    def _upload(self, arr: np.ndarray, s: CudaStream) -> torch.Tensor:
        """The run array in device memory, copied on ``s`` so the kernel after it sees it."""
        host = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(s.torch):
            dev = host.to(self._torch_device, non_blocking=True)
        s.keep(host)
        return dev

    @staticmethod
    def _hold(s: CudaStream, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` for the next event on ``s``; and tell torch's caching allocator
        their device memory is in use on ``s``, so it is not reused under the queued work even
        if that event is dropped unseen."""
        for t in tensors:
            if t.is_cuda:
                t.record_stream(s.torch)
        s.keep(*tensors)

    def _check_rc(self, op: str, rc: int) -> None:
        if rc:
            raise DeviceError(f"{op} on {self.device} failed: {_RC.get(rc, f'return code {rc}')}")

    def _flat(self, t: torch.Tensor, name: str, host_ok: bool = False) -> None:
        ok = isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()
        where = getattr(t, "device", None)
        on_here = where is not None and where.type == "cuda" and where.index == self.index
        if not ok or not (on_here or (host_ok and where is not None and where.type == "cpu")):
            allowed = f"{self.device} or host memory" if host_ok else self.device
            raise DeviceError(f"{name}: expected a flat contiguous uint8 tensor on {allowed}, got "
                              f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} "
                              f"on {where}")

    def _stream(self, stream: DeviceStream) -> CudaStream:
        if not isinstance(stream, CudaStream):
            raise DeviceError(f"stream {stream!r} is not a CUDA stream of {self.device}")
        return stream
