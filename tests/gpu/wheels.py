"""Wheels the GPU machine lacks (NIXL), carried in a folder and put on sys.path without pip.

scripts/fetch_gpu_wheels.sh downloads them into ``.gpu-wheels/`` (ignored by git). A wheel is a
zip of an installed tree, so unpacking it into a temporary directory and putting that first on
``sys.path`` (and on the children's PYTHONPATH) is an install that touches nothing else.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wheel_dir() -> Path:
    return Path(os.environ.get("PDXFER_GPU_WHEELS") or REPO / ".gpu-wheels")


def expected_nixl_wheel() -> str:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"nixl_cu12-1.5.1-{tag}-{tag}-manylinux_2_28_x86_64.whl"


def fetch_hint() -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"missing wheel {expected_nixl_wheel()} in {wheel_dir()}: run scripts/fetch_gpu_wheels.sh {py} "
            f"where there is network, and carry .gpu-wheels/ to this machine")


def _fits(name: str) -> bool:
    """Whether a wheel's tags fit this interpreter (pure, abi3 or this CPython, this arch)."""
    parts = name[:-4].split("-")
    if len(parts) < 5:
        return False
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    arch = sysconfig.get_platform().split("-")[-1]
    py_ok = here in py.split(".") or py in ("py3", "py2.py3") or (abi == "abi3" and py.startswith("cp3"))
    plat_ok = plat == "any" or plat.endswith(arch)
    return py_ok and plat_ok


def unpack_wheels() -> list[str]:
    """Unpack every fitting wheel of :func:`wheel_dir` into one temporary directory put first on
    sys.path and PYTHONPATH; returns the wheels' file names (empty when there are none)."""
    d = wheel_dir()
    names = sorted(p.name for p in d.glob("*.whl") if _fits(p.name)) if d.is_dir() else []
    if not names:
        return []
    target = tempfile.mkdtemp(prefix="pdxfer-gpu-wheels-")
    atexit.register(shutil.rmtree, target, True)
    for name in names:
        with zipfile.ZipFile(d / name) as z:
            z.extractall(target)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH", "")) if p)
    return names
