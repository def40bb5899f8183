"""The one small interface behind which every GPU-only operation sits.

Streams, asynchronous copies (any direction: device <-> pinned host, device <-> device), events
and the native kernel launches. Everything around them -- bounce buffers, staging in device
memory, publish fences -- is written against this interface, so CI runs it with the CPU
stand-in (:mod:`pdxfer.device.cpu`) and a GPU machine with :mod:`pdxfer.device.cuda`.

Buffers are flat ``uint8`` torch tensors (:func:`flat_bytes` of a KV tensor's storage, or what
:meth:`DeviceOps.alloc` returns) addressed by byte offsets, so one code path serves registered
KV regions, staging areas and bounce buffers alike.

Contract, as on a CUDA stream: operations enqueued on one stream run in order, asynchronously
to the caller; their results may be used only after an event recorded after them has
completed. Nothing here blocks without a bound.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from pdxfer.kv.blockgeom import BlockGeometry


class DeviceError(RuntimeError):
    """A device operation failed or a device is unusable; the message names the device and why."""


class DeviceStream(abc.ABC):
    """An ordered queue of device work. ``handle`` is what native launches take (a
    ``cudaStream_t`` as an int; 0 for the stand-in)."""

    handle: int = 0


class DeviceEvent(abc.ABC):
    """A point in a stream: completed once everything enqueued before it has run."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Non-blocking: has everything before the event completed?"""

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Block at most ``timeout`` seconds; True when the event completed in time."""

    @property
    def error(self) -> str | None:
        """Why the work before the event failed (the stand-in reports its exceptions here);
        None when it did not, or it has not finished."""
        return None


class DeviceOps(abc.ABC):
    """Operations on one device's memory (see the module docstring)."""

    device: str  # "cpu" or "cuda:N": where alloc() puts memory
    is_gpu: bool = False

    @abc.abstractmethod
    def new_stream(self) -> DeviceStream:
        """A stream of its own (transfers never queue behind vLLM's compute stream)."""

    @abc.abstractmethod
    def current_stream(self) -> DeviceStream:
        """The stream the caller's work runs on (vLLM's compute stream in a worker)."""

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory as a flat uint8 tensor (staging)."""

    @abc.abstractmethod
    def alloc_host_pinned(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory as a flat uint8 tensor (bounce buffers)."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, dst_off: int, src: torch.Tensor, src_off: int, nbytes: int,
             stream: DeviceStream) -> None:
        """Enqueue ``dst[dst_off:+nbytes] = src[src_off:+nbytes]`` on ``stream`` (flat uint8
        tensors, each on this device or in host memory)."""

    @abc.abstractmethod
    def copy_runs(self, src: torch.Tensor, dst: torch.Tensor, runs: Any, stream: DeviceStream) -> None:
        """Enqueue :func:`pdxfer.device.native.copy_runs` (runs checked before anything is enqueued)."""

    @abc.abstractmethod
    def scatter_tokens(self, src: torch.Tensor, dst: torch.Tensor, src_geom: BlockGeometry,
                       dst_geom: BlockGeometry, runs: Any, stream: DeviceStream,
                       elem_size: int | None = None) -> None:
        """Enqueue :func:`pdxfer.device.native.scatter_tokens` (runs checked before anything is
        enqueued). ``elem_size``: the KV element size when both buffers are flat bytes."""

    @abc.abstractmethod
    def record_event(self, stream: DeviceStream) -> DeviceEvent:
        """An event after everything enqueued on ``stream`` so far."""

    def close(self) -> None:
        """Stop any threads the implementation started (idempotent)."""


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor on ``t``'s device (byte offsets into
    it are the region offsets of :mod:`pdxfer.kv.layout`)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))
