"""pdxfer-probe end to end on tiny matrices: rows, byte checks, baselines, serve/read, bad input.
(Speed is never asserted here; bench/probe.py measures it.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pdxfer.probe.cli import parse_list, parse_size

from .conftest import REPO, child_env, read_line, stop

pytestmark = pytest.mark.timeout(180)


def run_probe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdxfer.probe.cli", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_sizes_and_lists_parse_or_fail_clearly():
    assert parse_size("32KiB") == 32768 and parse_size("16MiB") == 16 << 20 and parse_size("4096") == 4096
    assert parse_list("32KiB,16MiB", parse_size) == [32768, 16 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="bad size"):
        parse_size("12 parsecs")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_list("1,0", int)


def test_loopback_sweep_checks_bytes_and_writes_json(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "bw.png"
    r = run_probe("--loopback", "--transport", "tcp", "--region-size", "8MiB", "--block-sizes", "4KiB,64KiB,16MiB",
                  "--batches", "1,16", "--iters", "3", "--check", "--baseline", "--cpu", "--json", str(out),
                  "--plot", str(png))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    # 16 MiB does not fit the 8 MiB region: skipped with a reason, the other 4 points measured.
    assert "skipping 16MiB x 1" in r.stderr
    assert sorted((x["block_size"], x["batch"]) for x in rows) == [(4096, 1), (4096, 16), (65536, 1), (65536, 16)]
    for x in rows:
        assert x["transport"] == "tcp" and x["gbps"] > 0 and x["check"] == "ok"
        assert x["baseline"] == "raw_socket" and x["baseline_gbps"] > 0 and x["memcpy_gbps"] > 0
        assert x["reader_cpu_s_per_gb"] > 0 and x["holder_cpu_s_per_gb"] >= 0
        assert x["baseline_reader_cpu_s_per_gb"] > 0
    assert "B/W (GB/s)" in r.stdout and "[4/4" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_two_host_mode_serve_then_read(tmp_path):
    serve = subprocess.Popen([sys.executable, "-m", "pdxfer.probe.cli", "serve", "--host", "127.0.0.1",
                              "--port", "0", "--region-size", "4MiB", "--transport", "tcp"],
                             cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr = read_line(serve, "PROBE-SERVE ", 60).split()[1]
        r = run_probe("read", "--peer", addr, "--block-sizes", "32KiB", "--batches", "64", "--iters", "2",
                      "--check", "--json", str(tmp_path / "r.json"))
        assert r.returncode == 0, r.stderr[-3000:]
        (row,) = json.loads((tmp_path / "r.json").read_text())
        assert (row["block_size"], row["batch"], row["check"]) == (32768, 64, "ok")
        bad = run_probe("read", "--peer", addr, "--transport", "nixl", "--block-sizes", "32KiB", "--batches", "1")
        assert "skipping nixl" in bad.stderr
    finally:
        stop(serve)
