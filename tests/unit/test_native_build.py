"""How pdxfer.device.native finds, builds or gives up on its library, and the CUDA twins' compile check."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdxfer.device import native

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "native" / "build.sh"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No packaged library, an empty cache, and the backend re-chosen afterwards."""
    monkeypatch.setattr(native, "_PKG_DIR", tmp_path / "pkg")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("PDXFER_NATIVE", "PDXFER_NATIVE_LIB", "PDXFER_NATIVE_BUILD"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path
    monkeypatch.undo()
    native.reload()


def test_forced_torch_path_says_why(fresh, monkeypatch, caplog):
    monkeypatch.setenv("PDXFER_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="pdxfer.device.native"):
        assert native.reload() == "torch"
    assert "PDXFER_NATIVE=0" in native.backend_reason()
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert native.library_path() is None
    src, dst = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    native.copy_runs(src, dst, [(4, 0, 4)])
    assert dst[:4].tolist() == [4, 5, 6, 7]


def test_no_library_and_no_build_falls_back(fresh, monkeypatch):
    monkeypatch.setenv("PDXFER_NATIVE_BUILD", "0")
    assert native.reload() == "torch"
    assert "not built" in native.backend_reason() and "lazy build disabled" in native.backend_reason()


def test_required_library_missing_is_an_error(fresh, monkeypatch):
    monkeypatch.setenv("PDXFER_NATIVE_BUILD", "0")
    monkeypatch.setenv("PDXFER_NATIVE", "1")
    with pytest.raises(RuntimeError, match="PDXFER_NATIVE=1 but the native library is unavailable"):
        native.reload()


def test_bad_mode_and_bad_explicit_library(fresh, monkeypatch):
    monkeypatch.setenv("PDXFER_NATIVE", "yes")
    with pytest.raises(ValueError, match="PDXFER_NATIVE must be 0, 1 or auto, got 'yes'"):
        native.reload()
    monkeypatch.setenv("PDXFER_NATIVE", "auto")
    monkeypatch.setenv("PDXFER_NATIVE_LIB", str(fresh / "nope.so"))
    assert native.reload() == "torch"
    assert "nope.so did not load" in native.backend_reason()
    # A real shared library that is not ours: refused by symbol, not crashed on.
    import ctypes.util
    libm = ctypes.util.find_library("m")
    if libm:
        monkeypatch.setenv("PDXFER_NATIVE_LIB", libm)
        assert native.reload() == "torch"
        assert "lacks a pdxfer native symbol" in native.backend_reason()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the lazy build cannot run")
def test_lazy_build_into_user_cache(fresh):
    assert native.reload() == "native"
    path = Path(native.library_path())
    assert path.is_relative_to(fresh / "cache" / "pdxfer" / "native")
    assert "built on first use" in native.backend_reason()
    # Second load reuses the cached build (no compiler run: the file is not rewritten).
    mtime = path.stat().st_mtime_ns
    assert native.reload() == "native" and path.stat().st_mtime_ns == mtime


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_stale_packaged_library_is_not_used(fresh, monkeypatch):
    pkg = fresh / "pkg" / "_native"
    subprocess.run(["bash", str(BUILD)], env=dict(os.environ, PDXFER_NATIVE_OUT=str(pkg)), check=True,
                   capture_output=True)
    lib = pkg / native.LIB_NAME
    assert native.reload() == "native" and native.library_path() == str(lib)
    os.utime(lib, (1, 1))  # older than every source file
    monkeypatch.setenv("PDXFER_NATIVE_BUILD", "0")
    assert native.reload() == "torch"
    assert "older than native/ sources" in native.backend_reason()


def test_cuda_twins_compile_with_expected_symbols(tmp_path):
    # PATH, a CUDA toolkit, or the wrapper scripts/setup.sh puts in the venv (PyPI's CUDA wheels).
    places = [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", os.path.join(sys.prefix, "bin", "nvcc")]
    nvcc = next((p for p in places if p and os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not found (scripts/setup.sh installs it into the venv): the CUDA twins cannot be compiled")
    if shutil.which("nm") is None:
        pytest.skip("nm not found: cannot list the compiled symbols")
    env = dict(os.environ, PDXFER_NATIVE_OUT=str(tmp_path), NVCC=nvcc)
    res = subprocess.run(["bash", str(BUILD), "--cuda"], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    so = tmp_path / "libpdxfer_native_cuda.so"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True,
                             check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert {"pdx_cuda_abi_version", "pdx_cuda_copy_runs", "pdx_cuda_scatter_tokens"} <= exported
    if shutil.which("readelf"):  # device code is embedded, not only host stubs
        sections = subprocess.run(["readelf", "-SW", str(so)], capture_output=True, text=True, check=True).stdout
        assert ".nv_fatbin" in sections
    cuobjdump = shutil.which("cuobjdump") or shutil.which("cuobjdump", path=str(Path(nvcc).parent))
    if cuobjdump:  # the device code is really there, for the architecture asked for
        elf = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
        assert "sm_90" in elf, elf
