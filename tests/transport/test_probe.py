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


# ---------------------------------------------------------------- GPU memory and topology

def _cuda_here() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_cuda_here(), reason="this host has a GPU: the refusal cannot be shown")
@pytest.mark.parametrize("mode", [("--loopback", "--transport", "nixl"), ("serve", "--port", "0")])
def test_memory_cuda_is_refused_at_once_without_a_gpu(mode):
    r = run_probe(*mode, "--memory", "cuda:0", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()  # one clear line, no traceback
    assert line.startswith("pdxfer-probe: --memory cuda:0: no CUDA device on this host")


def test_memory_spec_is_checked_and_cpu_stays_the_default():
    bad = run_probe("--memory", "gpu0", timeout=60)
    assert bad.returncode == 2 and "bad --memory 'gpu0'; use cpu or cuda:N" in bad.stderr
    from pdxfer.probe.cli import build_parser

    assert build_parser().parse_args([]).memory == "cpu"
    assert build_parser().parse_args(["--memory", "CUDA"]).memory == "cuda:0"


def test_device_check_zeroes_reads_then_compares_a_host_copy():
    """check_device_point over a host region standing in for a GPU one (to_host returns a copy):
    a read that lands nothing must fail even after an earlier good read left the right bytes."""
    from pdxfer.transport.plan import TransferPlan
    from pdxfer.probe import regions, server
    from pdxfer.probe.cli import check_device_point
    from pdxfer.probe.pattern import scattered_plan
    from pdxfer.transport import create_transport, transport_options
    from pdxfer.transport.base import RegisteredRegion

    size = 1 << 20
    holder = server.ProbeServer("127.0.0.1", 0, size, ["tcp"])
    t = create_transport("tcp", **transport_options("tcp"))
    try:
        buf = regions.ProbeBuffer("cpu", size)
        buf.to_host = lambda: buf.host.copy()  # type: ignore[method-assign]
        t.register([RegisteredRegion(0, buf.ptr, buf.nbytes)])
        peer = t.connect(bytes.fromhex(holder.meta["tcp"]), timeout=10)
        plan = scattered_plan(4096, 16, size, size, seed=3)
        assert check_device_point(t, peer, plan, buf, size, server.SEED, 30) == "ok"

        class NoOp:
            def read(self, peer, plan):
                return t.read(peer, TransferPlan((), 0))  # lands nothing

        assert check_device_point(NoOp(), peer, plan, buf, size, server.SEED, 30).startswith("FAILED (16 runs")
    finally:
        t.close()
        holder.close()


def _fake_gpu_tree(root) -> None:
    """One NVIDIA GPU and one RDMA NIC under the same PCIe switch, as sysfs lays them out."""
    import os

    sw = "pci0000:00/0000:00:01.0/0000:01:00.0"
    for path, cls, vendor in ((f"{sw}/0000:02:08.0/0000:03:00.0", "0x030200", "0x10de"),
                              (f"{sw}/0000:02:10.0/0000:04:00.0", "0x020700", "0x15b3")):
        d = root / "sys/devices" / path
        d.mkdir(parents=True)
        (d / "class").write_text(cls)
        (d / "vendor").write_text(vendor)
        bus = root / "sys/bus/pci/devices"
        bus.mkdir(parents=True, exist_ok=True)
        (bus / path.rsplit("/", 1)[1]).symlink_to(os.path.relpath(d, bus))
    (root / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    (root / "sys/class/infiniband/mlx5_0/device").symlink_to(root / "sys/devices" / sw / "0000:02:10.0/0000:04:00.0")


def test_devices_output_includes_the_topology_section(tmp_path):
    here = run_probe("--devices", "--no-ucx", timeout=60)
    assert "Traceback" not in here.stderr, here.stderr
    assert "GPU <-> NIC topology (PCIe, from sysfs):" in here.stdout and "GPUDirect RDMA:" in here.stdout
    _fake_gpu_tree(tmp_path)
    r = run_probe("--devices", "--no-ucx", "--sysfs-root", str(tmp_path), timeout=60)
    assert "  GPU 0000:03:00.0" in r.stdout and "PIX   mlx5_0 0000:04:00.0  (RDMA)" in r.stdout, r.stdout
    # where GPUs exist, what the NIXL transport would log at its first VRAM registration
    assert "  NIXL VRAM: UCX transports carrying GPU memory here:" in r.stdout
    assert "NIXL VRAM: reads of GPU memory from another host will bounce through host memory" in r.stdout
    j = run_probe("--devices", "--no-ucx", "--json", "--sysfs-root", str(tmp_path), timeout=60)
    topo = json.loads(j.stdout)["topology"]
    assert topo["affinity"] == [{"gpu": "0000:03:00.0", "nic": "0000:04:00.0", "names": ["mlx5_0"], "rdma": True,
                                 "link": "PIX"}]
    assert topo["gpudirect"]["possible"] is False  # the fake tree has no /proc: no peermem, no driver
