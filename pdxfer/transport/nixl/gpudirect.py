"""Can an RDMA NIC on this host read and write GPU memory directly (GPUDirect RDMA)?

Two kernel mechanisms exist: the ``nvidia_peermem`` module (``nv_peer_mem`` on old MLNX_OFED
installs) and dma-buf (kernel >= 5.12, NVIDIA's open kernel modules r515 or newer). Without
either, UCX moves GPU memory over the network by staging it in host memory.

Everything here reads procfs under a ``root`` path so tests can point it at a fake tree; the
decision itself (:func:`gpudirect_from`) is a pure function of what was read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMABUF_KERNEL = (5, 12)
DMABUF_DRIVER = 515  # first NVIDIA driver branch whose open kernel modules export dma-buf


@dataclass(frozen=True)
class GpuDirect:
    """Whether GPUDirect RDMA is possible, by which mechanism, and why (or why not)."""

    possible: bool
    mechanism: str | None  # "nvidia_peermem", "nv_peer_mem", "dma-buf" or None
    reason: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def loaded_modules(root: Path = Path("/")) -> frozenset[str]:
    """Names of the loaded kernel modules (``/proc/modules``); empty when the file is absent
    (a kernel built without module support, as on this development machine)."""
    text = _read(Path(root) / "proc/modules") or ""
    return frozenset(line.split()[0] for line in text.splitlines() if line.strip())


def kernel_version(root: Path = Path("/")) -> tuple[int, int] | None:
    """(major, minor) of the running kernel, or None when procfs does not say."""
    text = _read(Path(root) / "proc/sys/kernel/osrelease")
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvidia_driver(root: Path = Path("/")) -> str | None:
    """The NVIDIA kernel driver's version line (``/proc/driver/nvidia/version``), or None."""
    text = _read(Path(root) / "proc/driver/nvidia/version")
    return text.splitlines()[0].strip() if text and text.strip() else None


def _driver_branch(line: str) -> int | None:
    # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build ..."
    m = re.search(r"\s(\d{3,})\.\d+(?:\.\d+)?\s", f" {line} ")
    return int(m.group(1)) if m else None


def gpudirect_from(modules: frozenset[str], kernel: tuple[int, int] | None,
                   driver_line: str | None) -> GpuDirect:
    """The GPUDirect verdict from the loaded modules, the kernel version and the driver line."""
    for name in PEERMEM_MODULES:
        if name in modules:
            return GpuDirect(True, name, f"kernel module {name} is loaded")
    missing = "no nvidia_peermem module loaded"
    if driver_line is None:
        return GpuDirect(False, None, f"{missing}, and no NVIDIA driver is loaded (no /proc/driver/nvidia/version)")
    if kernel is None:
        return GpuDirect(False, None, f"{missing}, and the kernel version is unknown (dma-buf needs >= 5.12)")
    if kernel < DMABUF_KERNEL:
        return GpuDirect(False, None, f"{missing}, and kernel {kernel[0]}.{kernel[1]} is older than 5.12 "
                                      "(no dma-buf for device memory)")
    if "open kernel module" not in driver_line.lower():
        return GpuDirect(False, None, f"{missing}, and the NVIDIA driver is the proprietary kernel module, "
                                      "which does not export dma-buf (use the open kernel modules)")
    branch = _driver_branch(driver_line)
    if branch is None or branch < DMABUF_DRIVER:
        return GpuDirect(False, None, f"{missing}, and NVIDIA driver {branch or 'of unknown version'} is older "
                                      f"than {DMABUF_DRIVER} (no dma-buf export)")
    return GpuDirect(True, "dma-buf", f"dma-buf: kernel {kernel[0]}.{kernel[1]} with NVIDIA open kernel "
                                      f"modules {branch}")


def gpudirect(root: Path = Path("/")) -> GpuDirect:
    """:func:`gpudirect_from` over what this host (or the tree at ``root``) shows."""
    return gpudirect_from(loaded_modules(root), kernel_version(root), nvidia_driver(root))
