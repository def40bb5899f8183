"""Load pdxfer's native CPU kernels (native/pdx_cpu.cpp) and expose them with checked arguments.

Two operations over run lists, each one C call with threads and no Python per run:

* :func:`copy_runs` - batched memcpy, runs ``[src_off, dst_off, len]`` in bytes.
* :func:`scatter_tokens` - token-range / head-slice copy between two block geometries
  (``pdxfer.kv.blockgeom``), runs shaped like ``blockgeom.token_runs`` output.

Every argument is checked here, before C is called, with a ``ValueError`` naming the bad run; on
error nothing has been written. Without the library the same calls run a torch implementation
(``pdxfer.device.native_torch``); :func:`active_backend` says which one is in use and
:func:`backend_reason` why.

Where the library comes from, first match wins: ``$PDXFER_NATIVE_LIB``; ``pdxfer/_native/``
(``native/build.sh``, run by scripts/setup.sh) unless older than the sources next to it; a
per-user cache built on first use with g++ (bounded by ``PDXFER_NATIVE_BUILD_TIMEOUT`` s, 120).
``PDXFER_NATIVE=0`` forces the torch path, ``=1`` makes a missing library an error,
``PDXFER_NATIVE_BUILD=0`` disables the lazy build, ``PDXFER_NATIVE_THREADS`` sets the default
thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdxfer.device import native_torch
from pdxfer.kv.blockgeom import MAX_PARTS, TOK_RUN_FIELDS, BlockGeometry

log = logging.getLogger(__name__)

ABI_VERSION = 1  # must equal PDX_ABI_VERSION in native/pdx_native.h
LIB_NAME = "libpdxfer_native.so"
_PKG_DIR = Path(__file__).resolve().parent.parent  # pdxfer/
_SRC_DIR = _PKG_DIR.parent / "native"
_SOURCES = ("pdx_cpu.cpp", "pdx_native.h", "build.sh")
_ERR = {1: "bad argument", 2: "run out of range", 4: "out of memory for the run bookkeeping"}


@dataclass(frozen=True)
class RawBuffer:
    """Memory addressed by pointer (a registered region, a staging area) instead of a tensor."""

    ptr: int
    nbytes: int
    elem_size: int = 1  # 1: plain bytes, compatible with any element size


Buffer = torch.Tensor | RawBuffer
# An int64 [n, 3] (copy) or [n, 8] (token) array, or anything numpy turns into one.
RunsLike = np.ndarray | Sequence[Sequence[int]]


class _Part(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("base", "tok_stride", "head_stride", "dim_stride")]


class _Geom(ctypes.Structure):
    _fields_ = [("block_tokens", ctypes.c_int64), ("heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("nparts", ctypes.c_int64), ("parts", _Part * MAX_PARTS)]


# --------------------------------------------------------------------------- loading

class _State:
    lib: ctypes.CDLL | None = None
    path: str | None = None
    reason: str = "not loaded yet"
    loaded: bool = False


_state = _State()


def _sources_digest() -> str | None:
    if not all((_SRC_DIR / f).is_file() for f in _SOURCES):
        return None
    h = hashlib.sha256()
    for f in _SOURCES:
        h.update((_SRC_DIR / f).read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pdxfer" / "native"


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        version = lib.pdx_abi_version()
        lib.pdx_copy_runs, lib.pdx_scatter_tokens, lib.pdx_set_tuning  # noqa: B018 (all present?)
    except AttributeError as exc:  # some other library, or one from before a symbol existed
        raise OSError(f"{path} lacks a pdxfer native symbol: {exc}") from exc
    if version != ABI_VERSION:
        raise OSError(f"{path} has ABI version {version}, this pdxfer needs {ABI_VERSION}")
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pdx_copy_runs.argtypes = [p, i64, p, i64, p, i64, i32, ctypes.POINTER(i64)]
    lib.pdx_copy_runs.restype = i32
    lib.pdx_scatter_tokens.argtypes = [p, i64, p, i64, ctypes.POINTER(_Geom), ctypes.POINTER(_Geom), i32,
                                       p, i64, i32, ctypes.POINTER(i64)]
    lib.pdx_scatter_tokens.restype = i32
    lib.pdx_set_tuning.argtypes = [i64, i64, ctypes.POINTER(i64)]
    lib.pdx_set_tuning.restype = None
    return lib


def _stale(path: Path) -> bool:
    if not _SRC_DIR.is_dir():
        return False
    newest = max(((_SRC_DIR / f).stat().st_mtime for f in _SOURCES if (_SRC_DIR / f).is_file()), default=0.0)
    return path.stat().st_mtime < newest


def _build_into_cache(digest: str) -> Path:
    out = _cache_dir() / digest
    target = out / LIB_NAME
    if target.is_file():
        return target
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        raise OSError("no C++ compiler (g++) on PATH to build it")
    timeout = float(os.environ.get("PDXFER_NATIVE_BUILD_TIMEOUT", "120"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PDXFER_NATIVE_OUT=str(out))
    try:
        res = subprocess.run(["bash", str(_SRC_DIR / "build.sh")], env=env, capture_output=True,
                             text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"building {target} took longer than {timeout:.0f} s") from exc
    if res.returncode != 0:
        raise OSError(f"native/build.sh failed (rc {res.returncode}): {res.stderr.strip()[-500:]}")
    return target


def _find_library() -> tuple[ctypes.CDLL | None, str | None, str]:
    """(library, path, reason); reason explains the choice either way."""
    explicit = os.environ.get("PDXFER_NATIVE_LIB")
    if explicit:
        try:
            return _open(Path(explicit)), explicit, f"PDXFER_NATIVE_LIB={explicit}"
        except OSError as exc:
            return None, None, f"PDXFER_NATIVE_LIB={explicit} did not load: {exc}"
    problems = []
    packaged = _PKG_DIR / "_native" / LIB_NAME
    if packaged.is_file():
        if _stale(packaged):
            problems.append(f"{packaged} is older than native/ sources")
        else:
            try:
                return _open(packaged), str(packaged), f"built library {packaged}"
            except OSError as exc:
                problems.append(f"{packaged}: {exc}")
    else:
        problems.append(f"{packaged} not built (native/build.sh)")
    digest = _sources_digest()
    if digest is None:
        problems.append(f"no sources at {_SRC_DIR} to build from")
    elif os.environ.get("PDXFER_NATIVE_BUILD", "1") == "0":
        problems.append("lazy build disabled (PDXFER_NATIVE_BUILD=0)")
    else:
        try:
            path = _build_into_cache(digest)
            return _open(path), str(path), f"built on first use into {path}"
        except OSError as exc:
            problems.append(f"lazy build failed: {exc}")
    return None, None, "; ".join(problems)


def reload() -> str:
    """Re-read the environment and pick the backend again; returns :func:`active_backend`."""
    mode = os.environ.get("PDXFER_NATIVE", "auto")
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"PDXFER_NATIVE must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        _state.lib, _state.path, _state.reason = None, None, "PDXFER_NATIVE=0 forces the torch path"
    else:
        _state.lib, _state.path, _state.reason = _find_library()
        if _state.lib is None and mode == "1":
            raise RuntimeError(f"PDXFER_NATIVE=1 but the native library is unavailable: {_state.reason}")
    _state.loaded = True
    if _state.lib is None:
        log.info("pdxfer.device.native: using the torch path: %s", _state.reason)
    else:
        log.info("pdxfer.device.native: using %s", _state.path)
    return active_backend()


def _lib() -> ctypes.CDLL | None:
    if not _state.loaded:
        reload()
    return _state.lib


def active_backend() -> str:
    """``"native"`` when the C++ library is loaded, else ``"torch"``."""
    return "native" if _lib() is not None else "torch"


def backend_reason() -> str:
    _lib()
    return _state.reason


def library_path() -> str | None:
    _lib()
    return _state.path


def set_tuning(min_bytes_per_thread: int = 0, stream_min_bytes: int = 0) -> tuple[int, int] | None:
    """Native path, process-wide: use more than one thread only above ``min_bytes_per_thread``
    per thread (1 MiB), non-temporal stores from ``stream_min_bytes`` per call (8 MiB); 0 keeps
    a value. Tests use 1 to drive those paths with small inputs. Returns the previous values;
    None on the torch path."""
    lib = _lib()
    if lib is None:
        return None
    old = (ctypes.c_int64 * 2)()
    lib.pdx_set_tuning(min_bytes_per_thread, stream_min_bytes, old)
    return int(old[0]), int(old[1])


def default_threads() -> int:
    env = os.environ.get("PDXFER_NATIVE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(len(os.sched_getaffinity(0)), 8))


# --------------------------------------------------------------------------- argument checks

def _span(buf: Buffer, name: str) -> tuple[int, int, int]:
    """(ptr, nbytes, element size) of a buffer argument."""
    if isinstance(buf, RawBuffer):
        if buf.ptr <= 0 and buf.nbytes > 0:
            raise ValueError(f"{name}: RawBuffer pointer {buf.ptr:#x} is not a valid address")
        if buf.nbytes < 0:
            raise ValueError(f"{name}: RawBuffer nbytes {buf.nbytes} is negative")
        return buf.ptr, buf.nbytes, buf.elem_size
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or RawBuffer, got {type(buf).__name__}")
    if buf.device.type != "cpu":
        raise ValueError(f"{name}: tensor on {buf.device}; the CPU kernels need CPU memory "
                         "(CUDA twins: native/pdx_cuda.cu)")
    if not buf.is_contiguous():
        raise ValueError(f"{name}: tensor is not contiguous (strides {tuple(buf.stride())}); pass the "
                         "flat region it lives in")
    return buf.data_ptr(), buf.numel() * buf.element_size(), buf.element_size()


def _runs_array(runs: RunsLike, width: int, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(runs, dtype=np.int64))
    if arr.size == 0:
        return np.zeros((0, width), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(f"{what} must have shape [n, {width}], got {list(arr.shape)}")
    return arr


def _first_bad(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _check_copy_runs(runs: np.ndarray, src_n: int, dst_n: int) -> None:
    so, do, n = runs[:, 0], runs[:, 1], runs[:, 2]
    for mask, why in ((n < 0, "has a negative length"),
                      ((so < 0) | (do < 0), "has a negative offset"),
                      ((n > 0) & (so > src_n - n), f"reads past the end of src ({src_n} bytes)"),
                      ((n > 0) & (do > dst_n - n), f"writes past the end of dst ({dst_n} bytes)")):
        i = _first_bad(mask)
        if i is not None:
            raise ValueError(f"copy run {i} (src_off={so[i]}, dst_off={do[i]}, len={n[i]}) {why}")


def _check_geometries(src_geom: BlockGeometry, dst_geom: BlockGeometry) -> None:
    if len(src_geom.parts) != len(dst_geom.parts):
        raise ValueError(f"src geometry has {len(src_geom.parts)} parts, dst has {len(dst_geom.parts)}")
    if src_geom.head_dim != dst_geom.head_dim:
        raise ValueError(f"head_dim differs: src {src_geom.head_dim}, dst {dst_geom.head_dim}")


def _check_tok_runs(runs: np.ndarray, sg: BlockGeometry, dg: BlockGeometry, esize: int,
                    src_n: int, dst_n: int) -> None:
    c = {f: runs[:, i] for i, f in enumerate(TOK_RUN_FIELDS)}
    live = (c["ntok"] > 0) & (c["nheads"] > 0)
    checks = [
        ((c["ntok"] < 0) | (c["nheads"] < 0), "has a negative ntok or nheads"),
        ((c["src_off"] < 0) | (c["dst_off"] < 0), "has a negative block offset"),
        ((c["src_off"] % esize != 0) | (c["dst_off"] % esize != 0),
         f"has a block offset that is not a multiple of the element size {esize}"),
        (live & ((c["src_tok"] < 0) | (c["dst_tok"] < 0) | (c["src_head"] < 0) | (c["dst_head"] < 0)),
         "has a negative token or head index"),
        (live & (c["src_tok"] + c["ntok"] > sg.block_tokens),
         f"reads tokens past the src block size {sg.block_tokens}"),
        (live & (c["dst_tok"] + c["ntok"] > dg.block_tokens),
         f"writes tokens past the dst block size {dg.block_tokens}"),
        (live & (c["src_head"] + c["nheads"] > sg.heads), f"reads heads past src's {sg.heads}"),
        (live & (c["dst_head"] + c["nheads"] > dg.heads), f"writes heads past dst's {dg.heads}"),
    ]
    for mask, why in checks:
        i = _first_bad(mask)
        if i is not None:
            raise ValueError(f"token run {i} {{f: int(c[f][i]) for f in TOK_RUN_FIELDS}} {why}")
    for side, geom, off, tok, head, limit in (("src", sg, "src_off", "src_tok", "src_head", src_n),
                                              ("dst", dg, "dst_off", "dst_tok", "dst_head", dst_n)):
        for p, part in enumerate(geom.parts):
            last = (part.base + (c[tok] + c["ntok"] - 1) * part.tok_stride
                    + (c[head] + c["nheads"] - 1) * part.head_stride + (geom.head_dim - 1) * part.dim_stride)
            i = _first_bad(live & (c[off] + (last + 1) * esize > limit))
            if i is not None:
                raise ValueError(f"token run {i} {{f: int(c[f][i]) for f in TOK_RUN_FIELDS}} "
                                 f"touches {side} part {p} past the end of {side} ({limit} bytes)")


def _elem_size(src_es: int, dst_es: int, elem_size: int | None) -> int:
    sizes = {s for s in (src_es, dst_es) if s != 1}
    if len(sizes) > 1:
        raise ValueError(f"mismatched element size: src {src_es} bytes, dst {dst_es} bytes")
    if elem_size is None:
        elem_size = sizes.pop() if sizes else 1
    elif sizes and elem_size not in sizes:
        raise ValueError(f"mismatched element size: elem_size={elem_size} but the tensors hold "
                         f"{sizes.pop()}-byte elements")
    if elem_size not in (1, 2, 4, 8):
        raise ValueError(f"element size must be 1, 2, 4 or 8 bytes, got {elem_size}")
    return elem_size


def _geom_struct(g: BlockGeometry) -> _Geom:
    s = _Geom(g.block_tokens, g.heads, g.head_dim, len(g.parts))
    for i, p in enumerate(g.parts):
        s.parts[i] = _Part(p.base, p.tok_stride, p.head_stride, p.dim_stride)
    return s


def _bytes_view(ptr: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _raise_code(op: str, code: int, bad: ctypes.c_int64) -> None:
    # Python checks first, so reaching this means the two sets of checks disagree: say so loudly.
    raise ValueError(f"{op}: native library refused run {bad.value}: {_ERR.get(code, code)} "
                     "(passed pdxfer.device.native's checks; please report)")


def _sizes(buf: Buffer, name: str) -> tuple[int, int]:
    """(nbytes, element size) of a buffer on any device: what the checks need, no pointer."""
    if isinstance(buf, RawBuffer):
        return _span(buf, name)[1:]
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or RawBuffer, got {type(buf).__name__}")
    if not buf.is_contiguous():
        raise ValueError(f"{name}: tensor is not contiguous (strides {tuple(buf.stride())}); pass the "
                         "flat region it lives in")
    return buf.numel() * buf.element_size(), buf.element_size()


def check_copy_runs(src: Buffer, dst: Buffer, runs: RunsLike) -> np.ndarray:
    """Every check :func:`copy_runs` makes, on buffers of any device (the CUDA launches check
    here first: the kernels do no bounds checks). Returns the run array."""
    sn, _ = _sizes(src, "src")
    dn, _ = _sizes(dst, "dst")
    arr = _runs_array(runs, 3, "copy runs")
    _check_copy_runs(arr, sn, dn)
    return arr


def check_scatter_tokens(src: Buffer, dst: Buffer, runs: RunsLike, src_geom: BlockGeometry,
                         dst_geom: BlockGeometry, *, elem_size: int | None = None) -> tuple[np.ndarray, int]:
    """Every check :func:`scatter_tokens` makes, on buffers of any device. Returns the run
    array and the element size the kernel must use."""
    sn, ses = _sizes(src, "src")
    dn, des = _sizes(dst, "dst")
    esize = _elem_size(ses, des, elem_size)
    _check_geometries(src_geom, dst_geom)
    arr = _runs_array(runs, len(TOK_RUN_FIELDS), "token runs")
    _check_tok_runs(arr, src_geom, dst_geom, esize, sn, dn)
    return arr, esize


# --------------------------------------------------------------------------- public API

def copy_runs(src: Buffer, dst: Buffer, runs: RunsLike, *, threads: int | None = None) -> None:
    """``dst[d:d+n] = src[s:s+n]`` for every ``[s, d, n]`` row of ``runs`` (bytes).

    Zero-length runs and an empty list are no-ops. Destination runs must not overlap each other
    (they are copied concurrently); src and dst must not overlap.
    """
    sp, sn, _ = _span(src, "src")
    dp, dn, _ = _span(dst, "dst")
    arr = _runs_array(runs, 3, "copy runs")
    _check_copy_runs(arr, sn, dn)
    if arr.shape[0] == 0:
        return
    lib = _lib()
    if lib is None:
        native_torch.copy_runs(_bytes_view(sp, sn), _bytes_view(dp, dn), arr)
        return
    bad = ctypes.c_int64(-1)
    rc = lib.pdx_copy_runs(sp, sn, dp, dn, arr.ctypes.data, arr.shape[0],
                           threads or default_threads(), ctypes.byref(bad))
    if rc:
        _raise_code("copy_runs", rc, bad)


def scatter_tokens(src: Buffer, dst: Buffer, runs: RunsLike, src_geom: BlockGeometry,
                   dst_geom: BlockGeometry, *, elem_size: int | None = None,
                   threads: int | None = None) -> None:
    """Copy token ranges and head slices between blocks of two geometries.

    ``runs`` rows are ``[src_off, dst_off, src_tok, dst_tok, ntok, src_head, dst_head, nheads]``
    (offsets in bytes to the block starts; see ``blockgeom.token_runs``). Part i of the src
    geometry lands in part i of the dst geometry. ``elem_size`` defaults to the tensors' element
    size; byte tensors (uint8) and RawBuffers adopt it.
    """
    sp, sn, ses = _span(src, "src")
    dp, dn, des = _span(dst, "dst")
    esize = _elem_size(ses, des, elem_size)
    _check_geometries(src_geom, dst_geom)
    arr = _runs_array(runs, len(TOK_RUN_FIELDS), "token runs")
    _check_tok_runs(arr, src_geom, dst_geom, esize, sn, dn)
    if arr.shape[0] == 0:
        return
    lib = _lib()
    if lib is None:
        native_torch.scatter_tokens(_bytes_view(sp, sn), _bytes_view(dp, dn), arr, src_geom, dst_geom, esize)
        return
    bad = ctypes.c_int64(-1)
    sg, dg = _geom_struct(src_geom), _geom_struct(dst_geom)
    rc = lib.pdx_scatter_tokens(sp, sn, dp, dn, ctypes.byref(sg), ctypes.byref(dg), esize,
                                arr.ctypes.data, arr.shape[0], threads or default_threads(),
                                ctypes.byref(bad))
    if rc:
        _raise_code("scatter_tokens", rc, bad)
