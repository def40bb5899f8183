"""Finding and opening the CUDA twins of the native kernels (``libpdxfer_native_cuda.so``).

Where it comes from, first match wins: ``$PDXFER_NATIVE_CUDA_LIB``; ``pdxfer/_native/`` (built by
``bash native/build.sh --cuda``) unless older than the sources it was built from. Unlike the CPU
library there is no lazy build (nvcc takes minutes and needs the right CUDA_ARCH) and no fallback:
a missing or unusable library is a :class:`DeviceError` naming the file and the build command.
Loaded once per process, on the first kernel launch.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from pdxfer.device import native
from pdxfer.device.base import DeviceError

LIB_NAME = "libpdxfer_native_cuda.so"
BUILD_HINT = "bash native/build.sh --cuda"
_PKG_DIR = Path(__file__).resolve().parent.parent
_SRC_DIR = _PKG_DIR.parent / "native"
_SOURCES = ("pdx_cuda.cu", "pdx_native.h")
_SYMBOLS = ("pdx_cuda_abi_version", "pdx_cuda_copy_runs", "pdx_cuda_scatter_tokens")

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


def default_path() -> Path:
    return _PKG_DIR / "_native" / LIB_NAME


def _stale_reason(path: Path) -> str | None:
    if not _SRC_DIR.is_dir():
        return None  # an installed package without sources: nothing to be older than
    newer = [f for f in _SOURCES if (_SRC_DIR / f).is_file()
             and (_SRC_DIR / f).stat().st_mtime > path.stat().st_mtime]
    return f"{path} is older than native/{', native/'.join(newer)}" if newer else None


def open_library(path: Path) -> ctypes.CDLL:
    """Open ``path`` as the CUDA kernel library and declare its signatures; DeviceError when it
    cannot be opened, lacks a symbol, or has another ABI version than this pdxfer."""
    if not path.is_file():
        raise DeviceError(f"the CUDA kernel library {path} does not exist; build it with {BUILD_HINT}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise DeviceError(f"cannot load the CUDA kernel library {path}: {exc} (rebuild with {BUILD_HINT})") from exc
    missing = [s for s in _SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise DeviceError(f"{path} is not pdxfer's CUDA kernel library: it lacks {', '.join(missing)} "
                          f"(build it with {BUILD_HINT})")
    version = lib.pdx_cuda_abi_version()
    if version != native.ABI_VERSION:
        raise DeviceError(f"{path} has ABI version {version}, this pdxfer needs {native.ABI_VERSION}; "
                          f"rebuild with {BUILD_HINT}")
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pdx_cuda_copy_runs.argtypes = [p, p, p, i64, p]
    lib.pdx_cuda_copy_runs.restype = i32
    # The geometries go by value, as the C signature takes them.
    lib.pdx_cuda_scatter_tokens.argtypes = [p, p, native._Geom, native._Geom, i32, p, i64, p]
    lib.pdx_cuda_scatter_tokens.restype = i32
    return lib


def find_library() -> Path:
    """The path :func:`cuda_library` opens (DeviceError when none is usable)."""
    explicit = os.environ.get("PDXFER_NATIVE_CUDA_LIB")
    if explicit:
        return Path(explicit)
    path = default_path()
    if not path.is_file():
        raise DeviceError(f"the CUDA kernel library {path} is not built; build it with {BUILD_HINT}")
    stale = _stale_reason(path)
    if stale is not None:
        raise DeviceError(f"{stale}; rebuild it with {BUILD_HINT}")
    return path


def cuda_library() -> ctypes.CDLL:
    """The process's CUDA kernel library, opened on first use."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = open_library(find_library())
        return _loaded


def reset() -> None:
    """Forget the opened library (tests; a rebuilt file is opened again on next use)."""
    global _loaded
    with _lock:
        _loaded = None
