"""GPU <-> NIC affinity and the GPUDirect verdict over small fake sysfs/procfs trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdxfer.probe import gpu_topology as topo
from pdxfer.transport.nixl.gpudirect import gpudirect, gpudirect_from, kernel_version, loaded_modules

NV, GPU3D, VGA, IB_NIC, ETH = 0x10DE, 0x030200, 0x030000, 0x020700, 0x020000
OPEN_550 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)"
PROP_550 = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"


class Tree:
    """A fake root with /sys/devices, /sys/bus/pci/devices, /sys/class/{infiniband,net} and /proc."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def pci(self, path: str, cls: int = 0x060400, vendor: int = 0x8086, numa: int = -1) -> str:
        d = self.root / "sys/devices" / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "class").write_text(f"{cls:#08x}\n")
        (d / "vendor").write_text(f"{vendor:#06x}\n")
        (d / "numa_node").write_text(f"{numa}\n")
        bdf = path.rsplit("/", 1)[1]
        bus = self.root / "sys/bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        # relative, as the kernel makes them
        (bus / bdf).symlink_to(os.path.relpath(d, bus))
        return path

    def chain(self, path: str, numa: int = -1) -> None:
        """Bridges for every component above the last one (switch ports, root ports)."""
        parts = path.split("/")
        for i in range(2, len(parts)):
            sub = "/".join(parts[:i])
            if not (self.root / "sys/devices" / sub / "class").exists():
                self.pci(sub, numa=numa)

    def gpu(self, path: str, numa: int = -1, cls: int = GPU3D, vendor: int = NV) -> None:
        self.chain(path, numa)
        self.pci(path, cls, vendor, numa)

    def nic(self, path: str, ib: str | None = None, net: str | None = None, numa: int = -1,
            net_child: str | None = None) -> None:
        self.chain(path, numa)
        self.pci(path, IB_NIC if ib else ETH, 0x15B3, numa)
        target = self.root / "sys/devices" / path
        for cls, name in (("infiniband", ib), ("net", net)):
            if name:
                d = self.root / "sys/class" / cls / name
                d.mkdir(parents=True)
                dev = target / net_child if (cls == "net" and net_child) else target
                dev.mkdir(exist_ok=True)
                (d / "device").symlink_to(dev)

    def proc(self, modules: list[str] | None = None, kernel: str | None = None, driver: str | None = None) -> None:
        p = self.root / "proc"
        if modules is not None:
            p.mkdir(exist_ok=True)
            (p / "modules").write_text("".join(f"{m} 45056 0 - Live 0x0000000000000000\n" for m in modules))
        if kernel is not None:
            (p / "sys/kernel").mkdir(parents=True, exist_ok=True)
            (p / "sys/kernel/osrelease").write_text(kernel + "\n")
        if driver is not None:
            (p / "driver/nvidia").mkdir(parents=True, exist_ok=True)
            (p / "driver/nvidia/version").write_text(driver + "\nGCC version:  gcc version 12.2.0\n")


@pytest.fixture
def tree(tmp_path) -> Tree:
    return Tree(tmp_path)


SWITCH = "pci0000:00/0000:00:01.0/0000:01:00.0"  # root port, then a switch's upstream port


def links(rep: dict) -> dict[tuple[str, str], str]:
    return {(p["gpu"], p["nic"]): p["link"] for p in rep["affinity"]}


def test_gpu_and_nic_under_one_switch_is_pix_and_two_switches_pxb(tree):
    tree.gpu(f"{SWITCH}/0000:02:08.0/0000:03:00.0")
    tree.nic(f"{SWITCH}/0000:02:10.0/0000:04:00.0", ib="mlx5_0", net="ens1f0np0")
    # a second GPU one switch further down: two switches from the NIC
    tree.gpu(f"{SWITCH}/0000:02:18.0/0000:05:00.0/0000:06:00.0/0000:07:00.0")
    rep = topo.topology(tree.root)
    assert links(rep) == {("0000:03:00.0", "0000:04:00.0"): "PIX", ("0000:07:00.0", "0000:04:00.0"): "PXB"}
    (nic,) = rep["nics"]
    assert nic["names"] == ["mlx5_0", "ens1f0np0"] and nic["rdma"]  # one PCI function, both names


def test_across_host_bridges_node_or_sys_by_numa(tree):
    tree.gpu("pci0000:00/0000:00:01.0/0000:17:00.0", numa=0)
    tree.nic("pci0000:80/0000:80:01.0/0000:81:00.0", ib="mlx5_1", numa=1)
    tree.nic("pci0000:40/0000:40:01.0/0000:41:00.0", ib="mlx5_2", numa=0)
    tree.nic("pci0000:00/0000:00:02.0/0000:18:00.0", ib="mlx5_3", numa=0)
    rep = topo.topology(tree.root)
    assert links(rep) == {("0000:17:00.0", "0000:81:00.0"): "SYS", ("0000:17:00.0", "0000:41:00.0"): "NODE",
                          ("0000:17:00.0", "0000:18:00.0"): "PHB"}
    assert rep["gpus"] == [{"address": "0000:17:00.0", "numa_node": 0}]
    text = "\n".join(topo.format_text(rep))
    # best link first under each GPU
    assert text.index("PHB   mlx5_3") < text.index("NODE  mlx5_2") < text.index("SYS   mlx5_1")


def test_unknown_numa_across_host_bridges_is_node_not_sys():
    assert topo.link_between(("pci0000:00", "0000:00:01.0"), ("pci0000:80", "0000:80:01.0"), None, 1) == "NODE"
    assert topo.link_between(("pci0000:00", "0000:00:01.0"), ("pci0000:80", "0000:80:01.0"), 0, 1) == "SYS"


def test_only_nvidia_gpus_count_and_netdevs_resolve_to_their_pci_function(tree):
    tree.gpu("pci0000:00/0000:00:04.0", cls=VGA)  # an NVIDIA VGA controller counts
    tree.gpu("pci0000:00/0000:00:05.0", vendor=0x1002)  # another vendor's GPU does not
    tree.gpu("pci0000:00/0000:00:06.0", cls=0x068000)  # an NVIDIA bridge (NVSwitch) is not a GPU
    tree.nic("pci0000:00/0000:00:03.0", net="eth0", net_child="virtio2")  # netdev behind a virtio child
    (tree.root / "sys/class/net/lo").mkdir(parents=True)  # no device: skipped
    rep = topo.topology(tree.root)
    assert [g["address"] for g in rep["gpus"]] == ["0000:00:04.0"]
    assert rep["nics"] == [{"address": "0000:00:03.0", "numa_node": None, "names": ["eth0"], "rdma": False}]
    assert links(rep) == {("0000:00:04.0", "0000:00:03.0"): "PHB"}


def test_no_nic_and_no_gpu_say_so(tree):
    tree.gpu(f"{SWITCH}/0000:02:08.0/0000:03:00.0")
    assert "    no NIC on the PCI bus" in topo.format_text(topo.topology(tree.root))
    empty = topo.topology(tree.root / "nothing")
    assert empty["gpus"] == [] and "no NVIDIA GPU" in empty["reason"]
    assert topo.warnings_for(empty) == []


def test_peermem_present_or_absent(tree):
    tree.proc(modules=["mlx5_ib", "nvidia"], kernel="5.4.0-150-generic", driver=OPEN_550)
    gd = gpudirect(tree.root)
    assert not gd.possible and "no nvidia_peermem" in gd.reason and "older than 5.12" in gd.reason
    tree.proc(modules=["mlx5_ib", "nvidia_peermem", "nvidia"])
    gd = gpudirect(tree.root)
    assert gd.possible and gd.mechanism == "nvidia_peermem"
    assert gpudirect_from(frozenset({"nv_peer_mem"}), None, None).mechanism == "nv_peer_mem"


def test_dma_buf_needs_new_kernel_and_open_modules_of_515_or_later(tree):
    tree.proc(modules=["nvidia"], kernel="6.8.0-45-generic", driver=OPEN_550)
    assert kernel_version(tree.root) == (6, 8) and loaded_modules(tree.root) == {"nvidia"}
    gd = gpudirect(tree.root)
    assert gd.possible and gd.mechanism == "dma-buf" and "550" in gd.reason
    assert not gpudirect_from(frozenset(), (6, 8), PROP_550).possible
    assert "proprietary" in gpudirect_from(frozenset(), (6, 8), PROP_550).reason
    old = OPEN_550.replace("550.54.15", "510.47.03")
    assert "older than 515" in gpudirect_from(frozenset(), (6, 8), old).reason
    assert "no NVIDIA driver" in gpudirect_from(frozenset(), (6, 8), None).reason
    # this development host: no /proc/modules at all
    assert loaded_modules(tree.root / "absent") == frozenset()


def test_warnings_for_far_nics_and_missing_gpudirect(tree):
    tree.gpu("pci0000:00/0000:00:01.0/0000:17:00.0", numa=0)
    tree.nic("pci0000:80/0000:80:01.0/0000:81:00.0", ib="mlx5_1", numa=1)
    tree.proc(modules=["nvidia_peermem"])
    (w,) = topo.warnings_for(topo.topology(tree.root))
    assert "GPU 0000:17:00.0" in w and "SYS" in w
    tree.nic("pci0000:00/0000:00:02.0/0000:18:00.0", ib="mlx5_0", numa=0)  # now one is close (PHB)
    tree.proc(modules=["mlx5_ib"])
    (w,) = topo.warnings_for(topo.topology(tree.root))
    assert w.startswith("GPUDirect RDMA is not possible") and "bounce through host memory" in w
