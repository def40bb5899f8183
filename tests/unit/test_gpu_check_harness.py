"""The prepared GPU check (tests/gpu, ``scripts/test.sh gpu``) tested where CI runs: no GPU.

The check itself needs a GPU; what CI can hold it to is that the gpu tier stays out of the way
on a machine without one, and that the harness -- the same checks on the asynchronous CPU
stand-in -- passes on good results and reports a wrong byte as FAIL with a non-zero exit.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("OUT", "PYTHON", "PDXFER_DEVICE_STANDIN"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    results = tmp_path / "gpu-check.txt"
    cmd = [sys.executable, "-m", "tests.gpu.check", "--standin", "--mib", "1", "--repeats", "1",
           "--results", str(results), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = proc.stdout.splitlines()
    assert results.read_text().splitlines() == lines, "the results file must hold everything printed"
    return proc, lines


@pytest.mark.may_skip(reason="on a machine with an NVIDIA GPU the gpu tier runs the real check instead",
                      match=r"^this machine has an NVIDIA device$")
def test_gpu_tier_without_a_gpu_prints_one_line_and_exits_0():
    if glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has an NVIDIA device")
    proc = subprocess.run(["bash", "scripts/test.sh", "gpu"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    out = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, out
    # One line and nothing else: no setup.sh (it would print its steps), no build, no check.
    assert len(out) == 1 and out[0].startswith("gpu check skipped: no GPU here"), out


def test_standin_run_passes_every_section(tmp_path):
    proc, lines = _check(tmp_path, "--random", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [ln for ln in lines if ln.startswith("FAIL")], proc.stdout
    passed = [ln for ln in lines if ln.startswith("PASS")]
    for what in ("PASS kernel cpu same block size 64", "PASS kernel NHD -> HND", "PASS kernel random scatter_tokens",
                 "PASS kernel random copy_runs", "PASS kernel bad run list refused", "PASS device copy",
                 "PASS move flash_nhd tcp", "PASS move flash_hnd tcp", "PASS move blocks_first_nhd tcp"):
        assert any(ln.startswith(what) for ln in passed), f"no {what!r} line in:\n{proc.stdout}"
    # bench/native.py's 15 layout pairs, each its own line
    assert len([ln for ln in passed if ln.startswith("PASS kernel") and "byte-equal;" in ln]) == 15
    assert lines[-1].startswith("gpu check OK:")


def test_corrupted_results_are_reported_fail(tmp_path):
    proc, lines = _check(tmp_path, "--random", "2", "--transports", "tcp", "--corrupt-for-test", "kernel,move")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    assert any(ln.startswith("FAIL kernel cpu same block size 64") and "1 of" in ln for ln in fails), proc.stdout
    assert any(ln.startswith("FAIL move flash_nhd tcp") and "differ" in ln for ln in fails), proc.stdout
    assert len(fails) == 2, proc.stdout  # only the damaged results
    assert lines[-1].startswith("gpu check FAILED:")


def test_bad_arguments_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", "--standin", "--corrupt-for-test", "nope",
                           "--results", str(tmp_path / "r.txt")], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and "--corrupt-for-test takes" in proc.stderr


def test_carried_wheels_go_on_sys_path_for_this_python_only(tmp_path):
    # Two wheels of one made-up package: one for this interpreter, one for another CPython. Only
    # the first may be unpacked, and the children (holders) must see it through PYTHONPATH.
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for tag, value in ((here, "this python"), ("cp27", "another python")):
        with zipfile.ZipFile(tmp_path / f"pdxfer_fake_wheel-1.0-{tag}-{tag}-manylinux_2_28_x86_64.whl", "w") as z:
            z.writestr("pdxfer_fake_wheel/__init__.py", f"WHO = {value!r}\n")
    code = ("import os, subprocess, sys; from tests.gpu.wheels import unpack_wheels; print(unpack_wheels()); "
            "import pdxfer_fake_wheel as m; print(m.WHO); "
            "print(subprocess.run([sys.executable, '-c', 'import pdxfer_fake_wheel as m; print(m.WHO)'], "
            "capture_output=True, text=True, env=os.environ).stdout.strip())")
    env = {**_env(), "PDXFER_GPU_WHEELS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    names, who, child = proc.stdout.splitlines()
    assert names == repr([f"pdxfer_fake_wheel-1.0-{here}-{here}-manylinux_2_28_x86_64.whl"])
    assert who == child == "this python"


def test_without_standin_on_a_machine_without_cuda_it_says_so_and_exits_2(tmp_path):
    env = {**_env(), "CUDA_VISIBLE_DEVICES": ""}  # hides a GPU, should the machine have one
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", "--results", str(tmp_path / "r.txt")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stderr, proc.stderr
    assert not (tmp_path / "r.txt").exists()


def test_ci_pytest_run_collects_nothing_from_tests_gpu():
    # The check's scripts need a GPU (or --standin) and run from scripts/test.sh gpu, not pytest.
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/gpu"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 5, proc.stdout + proc.stderr  # 5: no tests collected
