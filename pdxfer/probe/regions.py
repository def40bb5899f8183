"""Where ``pdxfer-probe`` puts its regions: host memory (numpy, the default) or a GPU (torch).

``--memory cuda:N`` allocates each region on that GPU; the holder fills it with the shared
pattern through a host copy, and the reader's byte check copies what landed back to host memory.
A host that cannot allocate there is refused before anything starts, in one line naming the
device and why. GPU regions have never been exercised: the development machines have no GPU.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import numpy as np

from pdxfer.probe.pattern import pattern


class MemoryUnavailable(RuntimeError):
    """The requested memory cannot be allocated on this host (the message says why)."""


def parse_memory(text: str) -> str:
    """``cpu`` or ``cuda:N`` (``cuda`` means ``cuda:0``), for argparse."""
    s = text.strip().lower()
    if s == "cpu":
        return s
    m = re.fullmatch(r"cuda(?::(\d+))?", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad --memory {text!r}; use cpu or cuda:N")
    return f"cuda:{m.group(1) or 0}"


def require(memory: str) -> None:
    """Raise MemoryUnavailable naming ``memory`` and the reason when it cannot be used here."""
    if memory == "cpu":
        return
    index = int(memory.split(":", 1)[1])
    try:
        import torch
    except ImportError as exc:
        raise MemoryUnavailable(f"--memory {memory}: torch is not installed, so no GPU memory ({exc})") from exc
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = (f"torch {torch.__version__} is built without CUDA" if not built else
               f"torch {torch.__version__} (CUDA {built}) finds no usable GPU (driver missing or "
               "CUDA_VISIBLE_DEVICES empty?)")
        raise MemoryUnavailable(f"--memory {memory}: no CUDA device on this host: {why}")
    count = torch.cuda.device_count()
    if index >= count:
        raise MemoryUnavailable(f"--memory {memory}: this process sees {count} CUDA device(s) "
                                f"(cuda:0..cuda:{count - 1})")


class ProbeBuffer:
    """One probe region: its address for registration, and the few operations the probe needs."""

    def __init__(self, memory: str, nbytes: int) -> None:
        require(memory)
        self.device = memory
        self.nbytes = nbytes
        self._host: np.ndarray | None = None
        self._dev: Any = None
        if memory == "cpu":
            # Touch every page now: np.zeros only maps them, and a first write into fresh memory
            # costs ~0.35 s per 128 MiB in this VM (10x a warm READ), which must never be timed.
            self._host = np.empty(nbytes, dtype=np.uint8)
            self._host.fill(0)
            self.ptr = int(self._host.ctypes.data)
        else:
            import torch

            self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=memory)
            torch.cuda.synchronize(memory)
            self.ptr = int(self._dev.data_ptr())

    @property
    def host(self) -> np.ndarray | None:
        """The numpy array of a host region (None for GPU regions)."""
        return self._host

    def zero(self) -> None:
        if self._host is not None:
            self._host[:] = 0
        else:
            self._dev.zero_()
            # a READ posted after this must not race the kernel that zeroes its destination
            self._sync()

    def fill_pattern(self, region: int, seed: int) -> None:
        data = pattern(region, self.nbytes, seed)
        if self._host is not None:
            self._host[:] = data
        else:
            import torch

            self._dev.copy_(torch.from_numpy(np.ascontiguousarray(data)))
            self._sync()

    def to_host(self) -> np.ndarray:
        """The region's bytes in host memory (a copy for GPU regions)."""
        if self._host is not None:
            return self._host
        return self._dev.cpu().numpy()

    def _sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
