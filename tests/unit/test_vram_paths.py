"""Which UCX transports carry NIXL VRAM, and when reads bounce through host memory.

The base input is real ``ucx_info -d`` output captured on the development host (Debian UCX 1.13,
no GPU, no RDMA device); variants append memory-domain blocks in the same format for the CUDA
and RDMA transports that host lacks. None of this has run on a GPU host.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from pdxfer.transport.nixl import vram_paths as vp
from pdxfer.transport.nixl.env import prepare_ucx_env, unavailable_reason
from pdxfer.transport.nixl.gpudirect import GpuDirect
from pdxfer.transport.nixl.vram_paths import (UcxView, decide, parse_ucx_info_b, parse_ucx_info_d,
                                              tls_allows, transports_from_modules)

prepare_ucx_env()  # before anything here loads NIXL/UCX

DATA = Path(__file__).parent / "data"
HOST_D = (DATA / "ucx_info_d_debian_1.13.txt").read_text()
HOST_B = (DATA / "ucx_info_b_debian_1.13_excerpt.txt").read_text()
# The module files of the UCX bundled in the nixl-cu12 1.5.1 wheel (ls nixl_cu12.libs/ucx).
BUNDLED = ["libucm_cuda.so.0.0.0", "libuct_cma.so.0.0.0", "libuct_cuda.so.0.0.0", "libuct_ib.so.0.0.0",
           "libuct_ib_efa.so.0.0.0", "libuct_ib_mlx5.so.0.0.0", "libuct_ib_mlx5_ext.so.0.0.0",
           "libuct_ib_mlx5_gda.so.0.0.0", "libuct_ib_mlx5_gdp.so.0.0.0", "libucx_perftest_cuda.so.0.0.0"]
PEERMEM = GpuDirect(True, "nvidia_peermem", "kernel module nvidia_peermem is loaded")
NO_GD = GpuDirect(False, None, "no nvidia_peermem module loaded, and kernel 5.4 is older than 5.12")


def md_block(md: str, tl: str, dev: str) -> str:
    """One memory domain with one transport, shaped like the host capture."""
    return (f"#\n# Memory domain: {md}\n#     Component: {md}\n#\n#      Transport: {tl}\n"
            f"#         Device: {dev}\n#           Type: accelerator\n#\n#      capabilities:\n"
            "#            bandwidth: 0.00/ppn + 10000.00 MB/sec\n#\n")


CUDA_COPY = md_block("cuda_cpy", "cuda_copy", "cuda")
CUDA_IPC = md_block("cuda_ipc", "cuda_ipc", "cuda")
GDR = md_block("gdr_copy", "gdr_copy", "cuda")
RC_MLX5 = md_block("mlx5_0", "rc_mlx5", "mlx5_0:1") + "#      Transport: dc_mlx5\n#         Device: mlx5_0:1\n"


def view_of(text: str, cuda_built: bool | None = True) -> UcxView:
    return UcxView("ucx_info -d", frozenset(parse_ucx_info_d(text)), cuda_built, runtime=True)


def test_host_capture_parses_to_what_ucx_listed():
    tls = parse_ucx_info_d(HOST_D)
    assert set(tls) == {"self", "tcp", "sysv", "posix", "cma"}
    assert sorted(tls["tcp"]) == ["eth0", "lo"]
    assert parse_ucx_info_b(HOST_B) is False  # Debian's UCX: uct_MODULES ":ib:rdmacm:cma", no cuda


def test_build_info_with_cuda_is_recognised():
    assert parse_ucx_info_b("#define HAVE_CUDA                 1\n")
    assert parse_ucx_info_b('#define uct_MODULES               ":cuda:ib:rdmacm:cma"\n')
    assert not parse_ucx_info_b('#define uct_MODULES               ":ib:cudax"\n#define HAVE_CUDA_H 1\n')


def test_this_host_warns_ucx_without_cuda_and_bounce():
    p = decide(view_of(HOST_D, parse_ucx_info_b(HOST_B)), None, [], frozenset(), NO_GD)
    assert p.carriers == () and not p.remote_direct
    assert any("built without CUDA" in w for w in p.warnings)
    assert any("bounce through host memory" in w and "no RDMA device" in w for w in p.warnings)
    assert "none" in p.info_line()


def test_cuda_without_rdma_device_carries_locally_and_bounces_remote_reads():
    p = decide(view_of(HOST_D + CUDA_COPY + CUDA_IPC), None, [], frozenset(), PEERMEM)
    assert p.carriers == ("cuda_ipc (same host, GPU to GPU)", "cuda_copy (GPU <-> host copies)")
    assert not p.remote_direct
    (w,) = p.warnings
    assert "another host will bounce through host memory" in w and "no RDMA device" in w


def test_rc_mlx5_with_peermem_is_direct_and_quiet():
    p = decide(view_of(HOST_D + CUDA_COPY + CUDA_IPC + RC_MLX5), None, ["mlx5_0"], frozenset(), PEERMEM)
    assert p.remote_direct and p.warnings == ()
    assert "rc_mlx5 (GPUDirect RDMA via nvidia_peermem)" in p.carriers
    assert "dc_mlx5 (GPUDirect RDMA via nvidia_peermem)" in p.carriers
    assert "NIC <-> GPU directly" in p.info_line()


def test_rc_mlx5_without_gpudirect_bounces_and_says_why():
    p = decide(view_of(HOST_D + CUDA_COPY + CUDA_IPC + RC_MLX5), None, ["mlx5_0"], frozenset(), NO_GD)
    assert not p.remote_direct
    assert "rc_mlx5 (through host memory)" in p.carriers
    (w,) = p.warnings
    assert "bounce through host memory" in w and "nvidia_peermem" in w and "5.12" in w


def test_ucx_tls_restrictions_are_honoured():
    text = HOST_D + CUDA_COPY + CUDA_IPC + RC_MLX5
    p = decide(view_of(text), "rc,cuda_copy", ["mlx5_0"], frozenset(), PEERMEM)
    assert p.remote_direct and "rc_mlx5 (GPUDirect RDMA via nvidia_peermem)" in p.carriers
    assert not any(c.startswith(("dc_mlx5", "cuda_ipc")) for c in p.carriers)
    assert any("between GPUs on this host" in w and "cuda_ipc" in w for w in p.warnings)
    p = decide(view_of(text), "^cuda", ["mlx5_0"], frozenset(), PEERMEM)
    assert p.carriers[0].endswith("(through host memory)") and not p.remote_direct
    assert any("UCX_TLS=^cuda enables none of" in w for w in p.warnings)
    p = decide(view_of(text), "tcp,cuda_copy,cuda_ipc", ["mlx5_0"], frozenset(), PEERMEM)
    assert any("UCX_TLS=tcp,cuda_copy,cuda_ipc enables no RDMA transport" in w for w in p.warnings)


def test_gdr_copy_needs_gdrdrv_when_inferred_from_modules():
    listed = decide(view_of(HOST_D + CUDA_COPY + GDR), None, [], frozenset(), NO_GD)
    assert any(c.startswith("gdr_copy") for c in listed.carriers)  # UCX opened it: it works
    built = transports_from_modules(BUNDLED + ["libuct_cuda_gdrcopy.so.0"])
    assert "gdr_copy" in built
    mods = UcxView("bundled", built, True, runtime=False)
    assert not any(c.startswith("gdr_copy") for c in decide(mods, None, [], frozenset(), NO_GD).carriers)
    assert any(c.startswith("gdr_copy") for c in decide(mods, None, [], frozenset({"gdrdrv"}), NO_GD).carriers)


def test_module_view_needs_an_rdma_device_for_rdma_transports():
    built = transports_from_modules(BUNDLED)
    assert {"cuda_copy", "cuda_ipc", "rc_mlx5", "dc_mlx5", "rc_verbs", "tcp"} <= built
    mods = UcxView("bundled", built, True, runtime=False)
    assert not decide(mods, None, [], frozenset(), PEERMEM).remote_direct
    assert decide(mods, None, ["mlx5_0"], frozenset(), PEERMEM).remote_direct


def test_ucx_modules_exclusion_drops_ib_and_its_dependents():
    assert not {"rc_verbs", "rc_mlx5", "dc_mlx5"} & transports_from_modules(BUNDLED, "^ib")
    assert "cuda_copy" in transports_from_modules(BUNDLED, "^ib")
    assert "cuda_copy" not in transports_from_modules(BUNDLED, "^cuda")
    assert transports_from_modules(BUNDLED, "cuda") >= {"cuda_copy", "tcp"}


def test_tls_aliases_and_roles():
    assert tls_allows(None, "rc_mlx5") and tls_allows("all", "gdr_copy")
    assert tls_allows("ud:aux,rc_x", "rc_mlx5") and not tls_allows("ud:aux,rc_x", "rc_verbs")
    assert tls_allows("ib", "dc_mlx5") and not tls_allows("^ib", "dc_mlx5") and tls_allows("^ib", "tcp")
    assert tls_allows("cuda", "gdr_copy") and not tls_allows("sm,tcp", "cuda_copy")


def test_bundled_ucx_is_found_next_to_the_nixl_package(tmp_path):
    pkg = tmp_path / "nixl_cu12"
    (tmp_path / "nixl_cu12.libs" / "ucx").mkdir(parents=True)
    pkg.mkdir()
    (pkg / "_api.py").write_text("")
    (tmp_path / "nixl_cu12.libs" / "libucp-b39b3ed9.so.0.0.0").write_text("")
    for n in BUNDLED:
        (tmp_path / "nixl_cu12.libs" / "ucx" / n).write_text("")
    api = str(pkg / "_api.py")
    v = vp.ucx_view_for(api, {"UCX_MODULES": "^ib"})
    assert v.cuda_built is True and not v.runtime and "bundled" in v.source and "UCX_MODULES=^ib" in v.source
    assert "cuda_ipc" in v.transports and "rc_mlx5" not in v.transports
    (tmp_path / "nixl_cu12.libs" / "ucx" / "libuct_cuda.so.0.0.0").unlink()
    assert vp.ucx_view_for(api, {}).cuda_built is False


def test_log_once_logs_one_info_line_then_nothing(monkeypatch, caplog):
    monkeypatch.setattr(vp, "_logged", vp.threading.Event())
    fake = vp.VramPaths(("cuda_copy (GPU <-> host copies)",), False, ("w1", "w2"), "test")
    monkeypatch.setattr(vp, "vram_paths", lambda api: fake)
    with caplog.at_level(logging.INFO, logger=vp.__name__):
        assert vp.log_once(None) is fake
        assert vp.log_once(None) is None
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 1 and "cuda_copy" in infos[0].getMessage()
    assert warns == ["NIXL VRAM: w1", "NIXL VRAM: w2"]


@pytest.mark.skipif(unavailable_reason() is not None, reason="NIXL not installed")
def test_vram_registration_of_host_memory_fails_clearly_and_logs_paths(caplog):
    """The real NIXL VRAM registration path: host memory declared as cuda:0 is refused by UCX
    (it sees host memory), and the transport says which region kind and device failed."""
    from pdxfer.transport.base import RegisteredRegion, TransportError
    from pdxfer.transport.nixl.transport import NixlTransport

    vp._logged.clear()
    buf = np.zeros(1 << 16, dtype=np.uint8)
    t = NixlTransport()
    try:
        with caplog.at_level(logging.INFO, logger=vp.__name__):
            with pytest.raises(TransportError, match=r"VRAM region\(s\) on \['cuda:0'\]"):
                t.register([RegisteredRegion(0, buf.ctypes.data, buf.nbytes, "cuda:0")])
        assert any(r.getMessage().startswith("NIXL VRAM: UCX transports") for r in caplog.records)
        t.register([RegisteredRegion(0, buf.ctypes.data, buf.nbytes, "cpu")])  # still usable
    finally:
        t.close()


def test_device_strings_map_to_nixl_memory_or_fail_naming_the_device():
    from pdxfer.transport.base import TransportError
    from pdxfer.transport.nixl.descriptors import mem_of

    assert mem_of("cpu") == ("DRAM", 0) and mem_of("cuda:3") == ("VRAM", 3)
    for bad, why in (("cuda", "needs a device index"), ("cuda:x", "cannot parse"), ("cuda:-1", "cannot parse"),
                     ("mps", "cpu or cuda:N")):
        with pytest.raises(TransportError, match=why):
            mem_of(bad)
