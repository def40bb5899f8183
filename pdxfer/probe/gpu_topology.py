"""GPU <-> NIC affinity from the PCIe tree in sysfs, in ``nvidia-smi topo -m`` terms.

A read of GPU memory by a NIC crosses the PCIe path between them; the closer they sit, the
less that path is shared and the more likely peer-to-peer DMA is allowed at all:

  PIX   at most one PCIe switch between them (both under the same switch)
  PXB   several PCIe switches, without crossing a host bridge
  PHB   through a PCIe host bridge (the CPU's root complex)
  NODE  between host bridges of one NUMA node
  SYS   across the interconnect between NUMA nodes (sockets)

GPUs are NVIDIA (vendor 0x10de) display or 3D controllers (class 0x0300 / 0x0302) under
``/sys/bus/pci/devices``; NICs are the PCI devices behind ``/sys/class/infiniband/*/device`` (RDMA)
and ``/sys/class/net/*/device``. Every read takes a ``root`` path so tests can build a fake tree.
The classification is computed, never measured: nothing here has run on a host with a GPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdxfer.transport.nixl.gpudirect import gpudirect

NVIDIA = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)
_BDF = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # best first
LEGEND = ("PIX: one PCIe switch; PXB: several switches; PHB: through the CPU's host bridge; "
          "NODE: between host bridges of one NUMA node; SYS: across NUMA nodes")


@dataclass
class PciDevice:
    address: str
    path: tuple[str, ...]  # from the host bridge ("pci0000:00") down to the device itself
    numa_node: int | None
    names: list[str] = field(default_factory=list)  # NICs: RDMA device and netdev names
    rdma: bool = False


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def pci_device_at(root: Path, link: Path) -> PciDevice | None:
    """The PCI device a sysfs link leads to (or the nearest PCI device above it: a netdev's
    ``device`` may be a virtio child of the PCI function); None when it is not on PCI."""
    devices = os.path.realpath(Path(root) / "sys/devices")
    real = os.path.realpath(link)
    if not real.startswith(devices + os.sep):
        return None
    parts = Path(os.path.relpath(real, devices)).parts
    last = max((i for i, p in enumerate(parts) if _BDF.fullmatch(p)), default=None)
    if last is None or not parts[0].startswith("pci"):
        return None
    path = tuple(parts[:last + 1])
    numa = _read(Path(devices, *path) / "numa_node")
    node = int(numa) if numa and numa.lstrip("-").isdigit() and int(numa) >= 0 else None
    return PciDevice(path[-1], path, node)


def nvidia_gpus(root: Path = Path("/")) -> list[PciDevice]:
    base = Path(root) / "sys/bus/pci/devices"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for e in entries:
        cls, vendor = _hex(_read(base / e / "class")), _hex(_read(base / e / "vendor"))
        if vendor == NVIDIA and cls is not None and cls >> 8 in GPU_CLASSES:
            dev = pci_device_at(root, base / e)
            if dev is not None:
                out.append(dev)
    return out


def nics(root: Path = Path("/")) -> list[PciDevice]:
    """PCI network devices, one entry per PCI function with all its RDMA and netdev names."""
    found: dict[str, PciDevice] = {}
    for cls_dir, rdma in (("infiniband", True), ("net", False)):
        base = Path(root) / "sys/class" / cls_dir
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            link = base / name / "device"
            if not link.exists():
                continue  # lo, bridges, tunnels: no hardware behind them
            dev = pci_device_at(root, link)
            if dev is None:
                continue
            entry = found.setdefault(dev.address, dev)
            entry.names.append(name)
            entry.rdma |= rdma
    return sorted(found.values(), key=lambda d: d.address)


def link_between(a: tuple[str, ...], b: tuple[str, ...], numa_a: int | None, numa_b: int | None) -> str:
    """nvidia-smi's name for the PCIe path between two devices given their sysfs paths.

    Different host bridges: SYS when both NUMA nodes are known and differ, else NODE (sysfs says
    -1 on single-node machines). Same host bridge: PHB when they share nothing below it; PIX
    when each sits at most one bridge below their closest common bridge (one switch), else PXB.
    """
    if a[0] != b[0]:
        return "SYS" if numa_a is not None and numa_b is not None and numa_a != numa_b else "NODE"
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common <= 1:
        return "PHB"
    below_a, below_b = len(a) - 1 - common, len(b) - 1 - common
    return "PIX" if below_a <= 1 and below_b <= 1 else "PXB"


def topology(root: Path = Path("/")) -> dict[str, Any]:
    """GPUs, NICs, the link between each pair, and whether GPUDirect RDMA is possible."""
    gpus, nets = nvidia_gpus(root), nics(root)
    gd = gpudirect(root)
    pairs = [{"gpu": g.address, "nic": n.address, "names": n.names, "rdma": n.rdma,
              "link": link_between(g.path, n.path, g.numa_node, n.numa_node)} for g in gpus for n in nets]
    rep: dict[str, Any] = {
        "gpus": [{"address": g.address, "numa_node": g.numa_node} for g in gpus],
        "nics": [{k: v for k, v in asdict(n).items() if k != "path"} for n in nets],
        "affinity": pairs,
        "gpudirect": asdict(gd),
    }
    if not gpus:
        rep["reason"] = "no NVIDIA GPU on the PCI bus (/sys/bus/pci/devices)"
    return rep


def warnings_for(rep: dict[str, Any]) -> list[str]:
    """GPU set-ups that make RDMA reads of GPU memory slow or impossible (only where GPUs and
    RDMA NICs both exist: anything else has nothing to read GPU memory with)."""
    if not rep["gpus"] or not any(n["rdma"] for n in rep["nics"]):
        return []
    warns = []
    if not rep["gpudirect"]["possible"]:
        warns.append(f"GPUDirect RDMA is not possible: {rep['gpudirect']['reason']}; "
                     "NIC reads of GPU memory will bounce through host memory")
    for g in rep["gpus"]:
        links = [p["link"] for p in rep["affinity"] if p["gpu"] == g["address"] and p["rdma"]]
        best = min(links, key=LINKS.index)
        if best in ("NODE", "SYS"):
            warns.append(f"GPU {g['address']}: the closest RDMA NIC is {best} away (peer-to-peer DMA across "
                         "host bridges is slow or refused; put the NIC under the GPU's PCIe switch)")
    return warns


def format_text(rep: dict[str, Any]) -> list[str]:
    lines = ["GPU <-> NIC topology (PCIe, from sysfs):"]
    if rep.get("reason"):
        lines.append(f"  {rep['reason']}")
    for g in rep["gpus"]:
        lines.append(f"  GPU {g['address']}" + (f" (NUMA {g['numa_node']})" if g["numa_node"] is not None else ""))
        pairs = [p for p in rep["affinity"] if p["gpu"] == g["address"]]
        if not pairs:
            lines.append("    no NIC on the PCI bus")
        for p in sorted(pairs, key=lambda p: (LINKS.index(p["link"]), p["nic"])):
            lines.append(f"    {p['link']:<4}  {'/'.join(p['names'])} {p['nic']}" + ("  (RDMA)" if p["rdma"] else ""))
    gd = rep["gpudirect"]
    lines.append(f"  GPUDirect RDMA: {'possible' if gd['possible'] else 'not possible'} ({gd['reason']})")
    if rep["gpus"]:
        lines.append(f"  {LEGEND}")
    return lines
