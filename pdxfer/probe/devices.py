"""pdxfer-probe --devices: what to check before blaming pdxfer for an RDMA problem.

    pdxfer-probe --devices [--json [FILE]] [--no-ucx] [--sysfs-root DIR]

Lists every RDMA device through pyverbs: per port its state, link layer, active and max MTU, and
its GIDs with their RoCE version and address (plus the netdev behind each GID, from sysfs); UCX's
view of the devices when ``ucx_info`` is installed; and warnings for the set-up errors that cost
RDMA users days: a port that is not ACTIVE, an Ethernet port without a RoCE v2 GID, and active
MTUs that differ between devices (two ends negotiating different MTUs fail at QP set-up).

It also reports GPU <-> NIC affinity from the PCIe tree (PIX/PXB/PHB/NODE/SYS, as
``nvidia-smi topo -m`` names them) and whether GPUDirect RDMA is possible (:mod:`pdxfer.probe.gpu_topology`).

On a host without RDMA, pyverbs raises instead of returning an empty list; this prints one line
for RDMA (``{"devices": [], "reason": ...}`` with --json) then the topology section, and exits 0,
since "no RDMA here" is an answer. Exit 1 means RDMA devices exist but a warning was raised
(including GPUs whose closest RDMA NIC is across host bridges, or no GPUDirect RDMA).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pdxfer.probe import gpu_topology
from pdxfer.transport.nixl import vram_paths
# Where Debian's python3-pyverbs lives. It is built for the system Python; a venv of the same
# minor version can import it, but adding the whole directory to sys.path would also shadow the
# venv's own packages with Debian's, so only the pyverbs package itself is loaded from there.
SYSTEM_DIST = Path("/usr/lib/python3/dist-packages")
SYSFS = Path("/sys/class/infiniband")
_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_PORT_STATE = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK_LAYER = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}


class PyverbsMissing(ImportError):
    """pyverbs is not importable (install python3-pyverbs, or rdma-core's pyverbs)."""


def load_pyverbs() -> ModuleType:
    """The pyverbs package: the environment's own, else Debian's python3-pyverbs."""
    try:
        return importlib.import_module("pyverbs.device")
    except ImportError:
        pass
    init = SYSTEM_DIST / "pyverbs" / "__init__.py"
    if not init.exists():
        raise PyverbsMissing(f"pyverbs is not installed (apt-get install python3-pyverbs; looked in {SYSTEM_DIST})")
    spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = mod
    try:
        spec.loader.exec_module(mod)
        return importlib.import_module("pyverbs.device")
    except ImportError as exc:
        sys.modules.pop("pyverbs", None)
        raise PyverbsMissing(f"{init.parent} does not import into Python {sys.version.split()[0]}: {exc}") from exc


def _sysfs_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _gid_type_name(value: int, link_layer: str) -> str:
    """ibv_query_gid_type answers in the *sysfs* enum: 0 is 'IB or RoCE v1', 1 is RoCE v2."""
    enums = importlib.import_module("pyverbs.enums")
    if value == enums.IBV_GID_TYPE_SYSFS_ROCE_V2:
        return "RoCE v2"
    if value == enums.IBV_GID_TYPE_SYSFS_IB_ROCE_V1:
        return "RoCE v1" if link_layer == "Ethernet" else "IB"
    return f"unknown ({value})"


def _gids(ctx: Any, dev: str, port: int, table_len: int, link_layer: str) -> list[dict]:
    """Non-zero GIDs of a port with their type (pyverbs) and netdev (sysfs)."""
    out = []
    for idx in range(table_len):
        try:
            gid = str(ctx.query_gid(port, idx))
        except Exception:  # noqa: BLE001 - an unpopulated entry raises on some providers
            continue
        if not gid or set(gid.replace(":", "")) <= {"0"}:
            continue
        try:
            gtype = _gid_type_name(int(ctx.query_gid_type(port, idx)), link_layer)
        except Exception:  # noqa: BLE001 - older kernels: fall back to sysfs
            gtype = _sysfs_text(SYSFS / dev / "ports" / str(port) / "gid_attrs" / "types" / str(idx)) or "unknown"
        ndev = _sysfs_text(SYSFS / dev / "ports" / str(port) / "gid_attrs" / "ndevs" / str(idx))
        ipv4 = gid[len("0000:0000:0000:0000:0000:ffff:"):] if gid.startswith("0000:0000:0000:0000:0000:ffff:") else None
        if ipv4:
            h = ipv4.replace(":", "")
            ipv4 = ".".join(str(int(h[i:i + 2], 16)) for i in range(0, 8, 2))
        out.append({"index": idx, "gid": gid, "type": gtype, "ipv4": ipv4, "netdev": ndev})
    return out


def rdma_devices() -> tuple[list[dict], str | None]:
    """(devices, reason): reason says why the list is empty when it is."""
    try:
        dmod = load_pyverbs()
    except PyverbsMissing as exc:
        return [], str(exc)
    try:
        devs = dmod.get_device_list()
    except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError when the kernel has no RDMA stack
        return [], f"no RDMA devices: the kernel exposes no RDMA stack ({type(exc).__name__}: {exc})"
    if not devs:
        return [], "no RDMA devices (none listed by libibverbs)"
    out = []
    for d in devs:
        name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
        entry: dict[str, Any] = {"name": name, "node_guid": None, "ports": []}
        try:
            with dmod.Context(name=name) as ctx:
                attr = ctx.query_device()
                entry["node_guid"] = str(attr.node_guid) if hasattr(attr, "node_guid") else None
                for port in range(1, attr.phys_port_cnt + 1):
                    pa = ctx.query_port(port)
                    link_layer = _LINK_LAYER.get(int(pa.link_layer), str(pa.link_layer))
                    entry["ports"].append({
                        "port": port,
                        "state": _PORT_STATE.get(int(pa.state), str(pa.state)),
                        "link_layer": link_layer,
                        "active_mtu": _MTU.get(int(pa.active_mtu)),
                        "max_mtu": _MTU.get(int(pa.max_mtu)),
                        "gids": _gids(ctx, name, port, int(pa.gid_tbl_len), link_layer),
                    })
        except Exception as exc:  # noqa: BLE001 - one broken device must not hide the others
            entry["error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return out, None


def warnings_for(devices: list[dict]) -> list[str]:
    """The set-up errors worth a warning, each naming the device and what to do."""
    warns = []
    mtus = {}
    for d in devices:
        if "error" in d:
            warns.append(f"{d['name']}: cannot be queried ({d['error']})")
        for p in d["ports"]:
            where = f"{d['name']} port {p['port']}"
            if p["state"] != "ACTIVE":
                warns.append(f"{where}: state {p['state']}, not ACTIVE (link down? for rxe: is its netdev up?)")
            if p["link_layer"] == "Ethernet" and not any(g["type"] == "RoCE v2" for g in p["gids"]):
                warns.append(f"{where}: no RoCE v2 GID (give the netdev an IP address; RoCE v2 routes over UDP 4791)")
            if p["state"] == "ACTIVE" and p["active_mtu"]:
                mtus[where] = p["active_mtu"]
    if len(set(mtus.values())) > 1:
        listed = ", ".join(f"{k} {v}" for k, v in sorted(mtus.items()))
        warns.append(f"active MTU differs between devices ({listed}): peers must agree on the path MTU "
                     "(set the same netdev MTU on both ends)")
    return warns


def ucx_view(timeout: float = 30.0) -> dict:
    """UCX's transports per RDMA device (``ucx_info -d``), or why it is unavailable."""
    exe = shutil.which("ucx_info")
    if not exe:
        return {"available": False, "reason": "ucx_info not found (apt-get install ucx-utils)"}
    from pdxfer.transport.nixl.env import env_for_device_query  # the one UCX_MODULES rule

    env = env_for_device_query(os.environ)
    try:
        res = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"ucx_info -d did not finish within {timeout:.0f} s"}
    transports: dict[str, list[str]] = {}
    tl = None
    for line in res.stdout.splitlines():
        s = line.strip("# \t")
        if s.startswith("Transport:"):
            tl = s.split(":", 1)[1].strip()
        elif s.startswith("Device:") and tl:
            transports.setdefault(s.split(":", 1)[1].strip(), []).append(tl)
    version = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=timeout).stdout.splitlines()
    return {"available": True, "version": version[0].strip("# ") if version else None, "transports": transports}


def nixl_vram(root: Path = Path("/")) -> dict[str, Any]:
    """What the NIXL transport would log at its first VRAM registration on this host."""
    paths = vram_paths.vram_paths(vram_paths.nixl_api_file(), os.environ, root)
    return {"info": paths.info_line(), "remote_direct": paths.remote_direct, "warnings": list(paths.warnings)}


def report(with_ucx: bool = True, root: Path = Path("/")) -> dict:
    devices, reason = rdma_devices()
    out: dict[str, Any] = {"devices": devices, "topology": gpu_topology.topology(root)}
    if out["topology"]["gpus"]:
        out["nixl_vram"] = nixl_vram(root)
    if reason:
        out["reason"] = reason
        return out
    out["warnings"] = warnings_for(devices) + gpu_topology.warnings_for(out["topology"])
    if with_ucx:
        out["ucx"] = ucx_view()
    return out


def format_text(rep: dict) -> str:
    topo = gpu_topology.format_text(rep["topology"]) if "topology" in rep else []
    if "nixl_vram" in rep:
        topo += [f"  {rep['nixl_vram']['info']}"] + [f"  NIXL VRAM: {w}" for w in rep["nixl_vram"]["warnings"]]
    if not rep["devices"]:
        return "\n".join([f"pdxfer-probe: {rep.get('reason', 'no RDMA devices')}", *topo])
    lines = []
    for d in rep["devices"]:
        lines.append(f"{d['name']}" + (f"  ERROR {d['error']}" if "error" in d else ""))
        for p in d["ports"]:
            lines.append(f"  port {p['port']}: {p['state']}, {p['link_layer']}, MTU active {p['active_mtu']} "
                         f"max {p['max_mtu']}")
            for g in p["gids"]:
                lines.append(f"    GID[{g['index']}] {g['gid']}  {g['type']}"
                             + (f"  {g['ipv4']}" if g["ipv4"] else "") + (f"  ({g['netdev']})" if g["netdev"] else ""))
    ucx = rep.get("ucx")
    if ucx:
        if ucx["available"]:
            for dev, tls in sorted(ucx["transports"].items()):
                lines.append(f"UCX {dev}: {', '.join(tls)}")
        else:
            lines.append(f"UCX: {ucx['reason']}")
    lines += topo
    lines += [f"WARNING: {w}" for w in rep.get("warnings", [])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdxfer-probe --devices", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", action="store_true", required=True)
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON to FILE (default: stdout)")
    ap.add_argument("--no-ucx", action="store_true", help="skip UCX's view (ucx_info)")
    ap.add_argument("--sysfs-root", type=Path, default=Path("/"), metavar="DIR",
                    help="read the PCIe topology and kernel facts under DIR instead of / (a copied tree)")
    a = ap.parse_args(argv)
    rep = report(with_ucx=not a.no_ucx, root=a.sysfs_root)
    if a.json:
        text = json.dumps(rep, indent=1)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text + "\n")
    else:
        print(format_text(rep))
    return 1 if rep.get("warnings") else 0
