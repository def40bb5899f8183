"""GPU-only operations behind one small interface (:mod:`pdxfer.device.base`): the CPU stand-in
(:mod:`pdxfer.device.cpu`) everywhere CI runs, CUDA (:mod:`pdxfer.device.cuda`) on GPUs.

:func:`device_ops_for` picks the implementation for the device a KV tensor lives on.
``PDXFER_DEVICE_STANDIN=async[:delay_s]`` makes CPU tensors use the asynchronous stand-in (tests
use it to run GPU-shaped flows on CPU memory).
"""

from __future__ import annotations

import os
import threading

from pdxfer.device.base import DeviceError, DeviceEvent, DeviceOps, DeviceStream, flat_bytes
from pdxfer.device.cpu import CpuStandIn

__all__ = ["DeviceError", "DeviceEvent", "DeviceOps", "DeviceStream", "CpuStandIn", "device_ops_for",
           "flat_bytes"]

_cache: dict[str, DeviceOps] = {}
_lock = threading.Lock()


def _standin_from_env() -> CpuStandIn:
    spec = os.environ.get("PDXFER_DEVICE_STANDIN", "").strip()
    if not spec or spec == "sync":
        return CpuStandIn()
    mode, _, delay = spec.partition(":")
    if mode != "async":
        raise DeviceError(f"PDXFER_DEVICE_STANDIN={spec!r}: expected 'sync' or 'async[:delay_s]'")
    try:
        return CpuStandIn(asynchronous=True, delay_s=float(delay) if delay else 0.0)
    except ValueError as exc:
        raise DeviceError(f"PDXFER_DEVICE_STANDIN={spec!r}: delay is not a number") from exc


def device_ops_for(device: str) -> DeviceOps:
    """The (shared, per device) operations for memory on ``device`` ("cpu", "cuda", "cuda:N")."""
    dev = str(device)
    if dev == "cuda":
        dev = "cuda:0"
    with _lock:
        ops = _cache.get(dev)
        if ops is None:
            if dev == "cpu":
                ops = _standin_from_env()
            elif dev.startswith("cuda:"):
                from pdxfer.device.cuda import CudaDevice

                ops = CudaDevice(int(dev.split(":", 1)[1]))
            else:
                raise DeviceError(f"no device operations for {device!r} (cpu or cuda:N)")
            _cache[dev] = ops
    return ops
