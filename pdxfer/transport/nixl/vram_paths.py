"""Which UCX transports will carry GPU memory (NIXL ``VRAM``) on this host, and whether reads
bounce through host memory.

:func:`decide` is a pure function over parsed facts (UCX's transports, ``UCX_TLS``, RDMA devices,
kernel modules, the GPUDirect verdict); :func:`log_once` gathers the facts and logs the verdict
when a transport first registers VRAM. UCX's view comes from the UCX that NIXL really loads: the
copy bundled in the NIXL wheel (its module files say what it was built with), else the system
UCX through ``ucx_info -d`` / ``ucx_info -b``.

Nothing here has run on a host with a GPU: the rules follow UCX's documented transport names.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterable, Mapping

from pdxfer.transport.nixl.gpudirect import GpuDirect, gpudirect, loaded_modules

log = logging.getLogger(__name__)

CUDA_TLS = ("cuda_ipc", "cuda_copy", "gdr_copy")
RDMA_TLS = ("rc_mlx5", "dc_mlx5", "rc_verbs", "ud_mlx5", "ud_verbs")
# UCX_TLS aliases (UCX's documentation of UCX_TLS) expanded to the transports named here.
_TLS_ALIASES = {
    "all": CUDA_TLS + RDMA_TLS + ("tcp", "cma", "posix", "sysv", "self"),
    "cuda": CUDA_TLS,
    "ib": RDMA_TLS,
    "rc": ("rc_mlx5", "rc_verbs"),
    "rc_x": ("rc_mlx5",),
    "rc_v": ("rc_verbs",),
    "dc": ("dc_mlx5",),
    "dc_x": ("dc_mlx5",),
    "ud": ("ud_mlx5", "ud_verbs"),
    "ud_x": ("ud_mlx5",),
    "ud_v": ("ud_verbs",),
    "shm": ("posix", "sysv", "cma"),
    "sm": ("posix", "sysv", "cma"),
    "mm": ("posix", "sysv"),
}
# UCX module library -> transports it provides (tcp, shared memory and self live in libuct itself).
_MODULE_TLS = {
    "cuda": ("cuda_copy", "cuda_ipc"),
    "cuda_gdrcopy": ("gdr_copy",),
    "ib": ("rc_verbs", "ud_verbs"),
    "ib_mlx5": ("rc_mlx5", "dc_mlx5", "ud_mlx5"),
    "cma": ("cma",),
}
_BUILTIN_TLS = ("self", "tcp", "posix", "sysv")
_ROLE = {"cuda_ipc": "same host, GPU to GPU", "cuda_copy": "GPU <-> host copies",
         "gdr_copy": "CPU-mapped GPU memory, small messages"}


@dataclass(frozen=True)
class UcxView:
    """What UCX offers. ``runtime``: True when UCX itself listed the transports it could open
    (``ucx_info -d``), False when inferred from the modules a build ships (capability only, so
    host evidence such as RDMA devices is still required)."""

    source: str
    transports: frozenset[str]
    cuda_built: bool | None  # None: unknown
    runtime: bool


@dataclass(frozen=True)
class VramPaths:
    carriers: tuple[str, ...]  # "transport (role)" entries, in preference order
    remote_direct: bool  # reads from another host go NIC <-> GPU without host memory
    warnings: tuple[str, ...]
    source: str

    def info_line(self) -> str:
        carried = ", ".join(self.carriers) if self.carriers else "none"
        remote = ("reads from another host go NIC <-> GPU directly" if self.remote_direct
                  else "reads from another host stage through host memory")
        return f"NIXL VRAM: UCX transports carrying GPU memory here: {carried}; {remote} (UCX view: {self.source})"


# ------------------------------------------------------------------ parsers (pure)

def parse_ucx_info_d(text: str) -> dict[str, list[str]]:
    """Transport -> devices from ``ucx_info -d`` output."""
    out: dict[str, list[str]] = {}
    tl = None
    for line in text.splitlines():
        s = line.strip("# \t")
        if s.startswith("Transport:"):
            tl = s.split(":", 1)[1].strip()
        elif s.startswith("Device:") and tl:
            out.setdefault(tl, []).append(s.split(":", 1)[1].strip())
    return out


def parse_ucx_info_b(text: str) -> bool:
    """True when ``ucx_info -b`` (the build configuration) says UCX was built with CUDA: its
    ``HAVE_CUDA`` define, or a ``cuda`` entry in the list of uct modules it built."""
    if re.search(r"^#define\s+HAVE_CUDA\s+1\b", text, re.M):
        return True
    m = re.search(r'^#define\s+uct_MODULES\s+"([^"]*)"', text, re.M)
    return m is not None and "cuda" in m.group(1).split(":")


def _name_list(spec: str | None) -> tuple[bool, set[str]] | None:
    """(negated, names) of a UCX name-list variable (``a,b`` or ``^a,b``); None when unset."""
    if spec is None or not spec.strip():
        return None
    s = spec.strip()
    neg = s.startswith("^")
    # ":aux" suffixes select a role for a transport, not a different transport
    names = {n.strip().split(":", 1)[0] for n in s.lstrip("^").split(",") if n.strip()}
    return neg, names


def modules_allowed(ucx_modules: str | None, module: str) -> bool:
    """Whether ``UCX_MODULES`` lets UCX load ``module`` (excluding ``ib`` also drops ``ib_*``,
    which depend on it)."""
    parsed = _name_list(ucx_modules)
    if parsed is None:
        return True
    neg, names = parsed
    hit = module in names or any(module.startswith(n + "_") for n in names)
    return not hit if neg else hit


def transports_from_modules(filenames: Iterable[str], ucx_modules: str | None = None) -> frozenset[str]:
    """Transports a UCX build offers, from the module libraries in its ``ucx`` directory."""
    tls = set(_BUILTIN_TLS)
    for f in filenames:
        m = re.fullmatch(r"libuct_(\w+?)\.so(\.[\d.]+)?", f)
        if m and m.group(1) in _MODULE_TLS and modules_allowed(ucx_modules, m.group(1)):
            tls.update(_MODULE_TLS[m.group(1)])
    return frozenset(tls)


def tls_allows(ucx_tls: str | None, transport: str) -> bool:
    """Whether ``UCX_TLS`` lets UCX use ``transport`` (unset: all)."""
    parsed = _name_list(ucx_tls)
    if parsed is None:
        return True
    neg, names = parsed
    expanded = set()
    for n in names:
        expanded.update(_TLS_ALIASES.get(n, (n,)))
    return transport not in expanded if neg else transport in expanded


# ------------------------------------------------------------------ the decision (pure)

def decide(view: UcxView, ucx_tls: str | None, rdma_devices: Iterable[str], modules: frozenset[str],
           gd: GpuDirect) -> VramPaths:
    """Which transports carry VRAM, whether remote reads avoid host memory, and what to warn about."""
    allowed = {t for t in view.transports if tls_allows(ucx_tls, t)}
    rdma_devs = sorted(rdma_devices)
    # A module-derived view only says what the build could do; the host must back it up.
    rdma = [t for t in RDMA_TLS if t in allowed and (view.runtime or rdma_devs)]
    cuda = [t for t in CUDA_TLS if t in allowed and (t != "gdr_copy" or view.runtime or "gdrdrv" in modules)]
    tls_note = f" (UCX_TLS={ucx_tls})" if ucx_tls else ""
    warnings = []
    if view.cuda_built is False:
        warnings.append(f"UCX ({view.source}) is built without CUDA: NIXL cannot register GPU memory through "
                        "it, and any GPU data would have to be copied to host memory first")
    elif not cuda:
        why = (f"UCX_TLS={ucx_tls} enables none of {', '.join(CUDA_TLS)} (add cuda_copy, or cuda)"
               if any(t in view.transports for t in CUDA_TLS) else f"UCX ({view.source}) lists no CUDA transport")
        warnings.append(f"no UCX transport can carry GPU memory: {why}")
    carriers = [f"{t} ({_ROLE[t]})" for t in cuda]
    remote_direct = bool(rdma) and gd.possible and bool(cuda)
    if remote_direct:
        carriers += [f"{t} (GPUDirect RDMA via {gd.mechanism})" for t in rdma]
    else:
        if not rdma:
            why = (f"UCX_TLS={ucx_tls} enables no RDMA transport" if rdma_devs and any(
                t in view.transports for t in RDMA_TLS) else
                   "no RDMA device in /sys/class/infiniband" if not rdma_devs else
                   f"UCX ({view.source}) has no RDMA transport")
        elif not gd.possible:
            why = f"no GPUDirect RDMA: {gd.reason}"
        else:
            why = "UCX cannot touch GPU memory (see above)"
        carriers += [f"{t} (through host memory)" for t in rdma]
        warnings.append(f"reads of GPU memory from another host will bounce through host memory{tls_note}: "
                        f"{why}")
    if cuda and "cuda_ipc" not in cuda:
        warnings.append("reads between GPUs on this host will bounce through host memory: "
                        f"cuda_ipc is not available{tls_note}")
    return VramPaths(tuple(carriers), remote_direct, tuple(warnings), view.source)


# ------------------------------------------------------------------ gathering facts (impure)

def nixl_api_file() -> str | None:
    """Where the NIXL Python API that :func:`~pdxfer.transport.nixl.env.load_nixl` would pick
    lives, found without importing it (importing NIXL loads UCX)."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            spec = importlib.util.find_spec(f"{name}._api")
        except ImportError:
            continue
        if spec is not None and spec.origin:
            return spec.origin
    return None


def bundled_ucx_dir(nixl_file: str) -> Path | None:
    """The UCX module directory of a NIXL wheel that bundles its own UCX (``<pkg>.libs/ucx``)."""
    pkg = Path(nixl_file).resolve().parent
    libs = pkg.parent / f"{pkg.name}.libs"
    if any(libs.glob("libucp*.so*")) and (libs / "ucx").is_dir():
        return libs / "ucx"
    return None


def ucx_view_for(nixl_file: str | None, env: Mapping[str, str], timeout: float = 10.0) -> UcxView:
    """UCX's view for the UCX that the NIXL API at ``nixl_file`` loads (bundled modules, else
    ``ucx_info``)."""
    mods = bundled_ucx_dir(nixl_file) if nixl_file is not None else None
    if mods is not None:
        names = os.listdir(mods)
        tls = transports_from_modules(names, env.get("UCX_MODULES"))
        filt = f", UCX_MODULES={env['UCX_MODULES']}" if env.get("UCX_MODULES") else ""
        return UcxView(f"modules of NIXL's bundled UCX in {mods}{filt}", tls,
                       any(n.startswith("libuct_cuda.so") for n in names), runtime=False)
    exe = shutil.which("ucx_info")
    if not exe:
        return UcxView("unknown (no bundled UCX, no ucx_info)", frozenset(), None, runtime=False)
    try:
        d = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=timeout, env=dict(env))
        b = subprocess.run([exe, "-b"], capture_output=True, text=True, timeout=timeout, env=dict(env))
    except (subprocess.TimeoutExpired, OSError) as exc:
        return UcxView(f"unknown (ucx_info failed: {exc})", frozenset(), None, runtime=False)
    return UcxView(f"{exe} -d", frozenset(parse_ucx_info_d(d.stdout)), parse_ucx_info_b(b.stdout), runtime=True)


def rdma_device_names(root: Path = Path("/")) -> list[str]:
    try:
        return sorted(os.listdir(Path(root) / "sys/class/infiniband"))
    except OSError:
        return []


def vram_paths(nixl_file: str | None, env: Mapping[str, str] = os.environ,
               root: Path = Path("/")) -> VramPaths:
    """:func:`decide` over this host, for the NIXL API at ``nixl_file`` (see :func:`nixl_api_file`)."""
    return decide(ucx_view_for(nixl_file, env), env.get("UCX_TLS"), rdma_device_names(root),
                  loaded_modules(root), gpudirect(root))


_logged = threading.Event()


def log_once(nixl_api: ModuleType | None) -> VramPaths | None:
    """Log the VRAM paths of this host (INFO, one line; WARNING per bounce) on the first call in
    this process; later calls return None. Never raises: a report must not stop a transport."""
    if _logged.is_set():
        return None
    _logged.set()
    try:
        paths = vram_paths(getattr(nixl_api, "__file__", None))
    except Exception as exc:  # noqa: BLE001 - best effort, said so
        log.warning("NIXL VRAM: could not work out which UCX transports carry GPU memory: %r", exc)
        return None
    log.info(paths.info_line())
    for w in paths.warnings:
        log.warning("NIXL VRAM: %s", w)
    return paths
