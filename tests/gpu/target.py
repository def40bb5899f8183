"""Where the check runs: the CUDA device, or the asynchronous CPU stand-in on CPU tensors.

Both go through :class:`pdxfer.device.base.DeviceOps`, so a stand-in run exercises every line
of the check (streams, events, bounded waits, byte comparisons) that the GPU run does.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pdxfer.device import DeviceError, DeviceOps, device_ops_for
from pdxfer.device.cpu import CpuStandIn

# Long enough for a 128 MiB kernel on a busy GPU; a hung launch still ends the check.
EVENT_TIMEOUT_S = 60.0
# The stand-in sleeps this long before every operation, so results read before their event
# completed would be stale (and the comparison would show it).
STANDIN_DELAY_S = 0.002


@dataclass
class Target:
    ops: DeviceOps | None  # None when the device's operations failed to load (the moves still run)
    device: str  # torch device string of the memory under test
    standin: bool

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def finish(self, stream: object, what: str) -> None:
        """Wait (bounded) for everything enqueued on ``stream``; raise if it failed or hung."""
        assert self.ops is not None
        ev = self.ops.record_event(stream)  # type: ignore[arg-type]
        if not ev.wait(EVENT_TIMEOUT_S):
            raise DeviceError(f"{what}: not complete after {EVENT_TIMEOUT_S:.0f} s")
        if ev.error:
            raise DeviceError(f"{what}: {ev.error}")

    def name(self) -> str:
        if self.standin:
            return (f"CPU stand-in (asynchronous, {STANDIN_DELAY_S * 1e3:.0f} ms per operation; "
                    "its timings measure the stand-in, not a device)")
        props = torch.cuda.get_device_properties(self.device)
        cc = torch.cuda.get_device_capability(self.device)
        return (f"{self.device}: {props.name}, sm_{cc[0]}{cc[1]}, {props.total_memory / 2**30:.0f} GiB, "
                f"torch {torch.__version__} (CUDA {torch.version.cuda})")


def make_target(standin: bool) -> Target:
    if standin:
        # Child processes (holders) and pdxfer code that asks device_ops_for("cpu") get the same
        # asynchronous stand-in through this variable.
        os.environ["PDXFER_DEVICE_STANDIN"] = f"async:{STANDIN_DELAY_S}"
        return Target(CpuStandIn(asynchronous=True, delay_s=STANDIN_DELAY_S), "cpu", True)
    return Target(device_ops_for("cuda:0"), "cuda:0", False)


def median_time(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    """Median wall time of ``fn`` (synchronised before and after), one untimed warm-up first."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def d2d_copy_seconds(target: Target, nbytes: int, repeats: int) -> float:
    """One torch ``copy_`` of ``nbytes`` between two buffers on the device: the yardstick."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=target.device).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, device=target.device)
    try:
        return median_time(lambda: b.copy_(a), target.sync, repeats)
    finally:
        del a, b


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two flat uint8 tensors first differ, for a FAIL line."""
    if got.numel() != want.numel():
        return f"sizes differ ({got.numel()} vs {want.numel()} bytes)"
    diff = torch.nonzero(got != want)
    if diff.numel() == 0:
        return "equal"
    i = int(diff[0, 0])
    return (f"{diff.shape[0]} of {got.numel()} bytes differ, first at byte {i} "
            f"(got {int(got[i])}, want {int(want[i])})")
