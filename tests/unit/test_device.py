"""The device interface: the CPU stand-in's stream semantics (what GPU-shaped code is tested
against), and what of the CUDA implementation can be checked without a GPU (import, refusal,
finding the kernel library). Nothing here has run on a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pdxfer.device as device
import pdxfer.device.cpu as cpu_mod
from pdxfer.device import native
from pdxfer.kv.blockgeom import segment_geometry
from pdxfer.device import CpuStandIn, DeviceError, device_ops_for
from pdxfer.device import cuda_lib
from pdxfer.kv.layout import CPU, describe_kv_caches
from pdxfer.vllm.metadata import NodeRead
from pdxfer.vllm.worker.staging import ReaderStaging, region_tensors
from tests.kv_pattern import as_cache, describe, encode
from tests.unit.test_staging import CASES as STAGING_CASES
from tests.unit.test_staging import _route as staging_route

REPO = Path(__file__).resolve().parents[2]
WAIT = 5.0


def _bytes(n: int, value: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


@pytest.fixture
def slow():
    ops = CpuStandIn(asynchronous=True, delay_s=0.05)
    yield ops
    ops.close()


# --------------------------------------------------------------------------- the CPU stand-in

def test_ops_on_one_stream_run_in_the_order_they_were_enqueued(slow):
    a, b, c = _bytes(64, 1), _bytes(64, 0), _bytes(64, 0)
    st = slow.new_stream()
    slow.copy(b, 0, a, 0, 64, st)  # b = a
    slow.copy(c, 0, b, 0, 64, st)  # c = b: right only if the first copy ran before
    slow.copy(b, 0, _bytes(64, 9), 0, 32, st)  # then half of b overwritten
    ev = slow.record_event(st)
    assert ev.wait(WAIT)
    assert torch.equal(c, _bytes(64, 1))
    assert b[:32].eq(9).all() and b[32:].eq(1).all()


def test_an_event_completes_only_after_the_ops_before_it(slow):
    src, dst = _bytes(4096, 7), _bytes(4096, 0)
    st = slow.new_stream()
    slow.copy(dst, 0, src, 0, 4096, st)
    ev = slow.record_event(st)
    assert not ev.query()  # the op sleeps 0.05 s first
    assert not ev.wait(0.0)
    assert ev.wait(WAIT) and ev.query() and ev.error is None
    assert dst.eq(7).all()
    later = slow.record_event(st)  # nothing after the first event: completes on its own
    assert later.wait(WAIT)


def test_async_results_are_late_a_read_before_the_event_sees_old_bytes(slow):
    src, dst = _bytes(256, 5), _bytes(256, 1)
    st = slow.new_stream()
    slow.copy_runs(src, dst, [[0, 0, 256]], st)
    ev = slow.record_event(st)
    assert dst.eq(1).all()  # what code that skips the event would see
    assert ev.wait(WAIT)
    assert dst.eq(5).all()


def test_streams_are_independent_queues(slow):
    s1, s2 = slow.new_stream(), slow.new_stream()
    dst = _bytes(8, 0)
    for _ in range(4):  # 0.2 s of work on s1
        slow.copy(dst, 0, _bytes(8, 3), 0, 8, s1)
    t0 = time.monotonic()
    assert slow.record_event(s2).wait(WAIT)
    assert time.monotonic() - t0 < 0.15  # an empty stream does not wait behind another


def test_bad_runs_raise_on_the_callers_thread_and_enqueue_nothing(slow):
    src, dst = _bytes(128, 4), _bytes(128, 0)
    st = slow.new_stream()
    with pytest.raises(ValueError, match="writes past the end of dst"):
        slow.copy_runs(src, dst, [[0, 0, 64], [0, 100, 64]], st)
    geom = segment_geometry(describe(CPU, encode(CPU, torch.zeros(1, 2, 2, 4, 1, 2)), 4))
    with pytest.raises(ValueError, match="token run 0"):
        slow.scatter_tokens(src, dst, geom, geom, [[0, 0, 0, 0, 9, 0, 0, 1]], st, elem_size=4)
    with pytest.raises(DeviceError, match="outside its 128-byte buffer"):
        slow.copy(dst, 100, src, 0, 64, st)
    with pytest.raises(DeviceError, match="flat uint8 host tensors"):
        slow.copy(torch.zeros(32), 0, src, 0, 16, st)
    ev = slow.record_event(st)
    assert ev.wait(WAIT) and ev.error is None
    assert dst.eq(0).all()  # not even the good first run of the refused list was copied


def test_an_op_failing_on_the_stream_shows_on_the_next_events_error(slow, monkeypatch):
    src, dst = _bytes(64, 2), _bytes(64, 0)
    st = slow.new_stream()
    before = slow.record_event(st)

    def broken(*_a, **_kw):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(cpu_mod.native, "copy_runs", broken)
    slow.copy_runs(src, dst, [[0, 0, 64]], st)  # passes the checks, fails when it runs
    ev = slow.record_event(st)
    assert ev.wait(WAIT)
    assert before.error is None
    assert ev.error is not None and "the device fell over" in ev.error
    slow.copy(dst, 0, src, 0, 64, st)
    sticky = slow.record_event(st)  # like a CUDA error: later work on the stream reports it too
    assert sticky.wait(WAIT) and "the device fell over" in sticky.error


def test_the_synchronous_stand_in_runs_inline_with_no_thread():
    threads = set(threading.enumerate())
    ops = CpuStandIn()
    st = ops.new_stream()
    src, dst = _bytes(64, 6), _bytes(64, 0)
    ops.copy_runs(src, dst, [[0, 0, 64]], st)
    assert dst.eq(6).all()  # done before the call returned
    assert ops.record_event(st).query()
    assert set(threading.enumerate()) <= threads  # started none


def test_device_ops_for_reads_the_stand_in_mode_from_the_environment(monkeypatch):
    monkeypatch.setattr(device, "_cache", {})
    monkeypatch.setenv("PDXFER_DEVICE_STANDIN", "async:0.01")
    ops = device_ops_for("cpu")
    try:
        assert isinstance(ops, CpuStandIn) and ops.asynchronous and ops.delay_s == 0.01
        assert device_ops_for("cpu") is ops  # one per device
    finally:
        ops.close()
    monkeypatch.setattr(device, "_cache", {})
    monkeypatch.setenv("PDXFER_DEVICE_STANDIN", "later")
    with pytest.raises(DeviceError, match="PDXFER_DEVICE_STANDIN='later'"):
        device_ops_for("cpu")
    with pytest.raises(DeviceError, match="no device operations for 'tpu:0'"):
        device_ops_for("tpu:0")


# --------------------------------------------------------------------------- CUDA without a GPU

def test_the_cuda_module_imports_without_a_gpu():
    code = "import pdxfer.device.cuda as c; print(c.CudaDevice.__name__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "CudaDevice"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_refused_naming_why(monkeypatch):
    from pdxfer.device.cuda import CudaDevice

    with pytest.raises(DeviceError, match=r"cuda:0: CUDA is not available to torch"):
        CudaDevice(0)
    monkeypatch.setattr(device, "_cache", {})
    with pytest.raises(DeviceError, match=r"cuda:1: CUDA is not available"):
        device_ops_for("cuda:1")
    with pytest.raises(DeviceError, match="index must be an int"):
        CudaDevice("0")  # type: ignore[arg-type]


def test_a_missing_cuda_library_names_the_file_and_the_build_command(monkeypatch, tmp_path):
    monkeypatch.delenv("PDXFER_NATIVE_CUDA_LIB", raising=False)
    monkeypatch.setattr(cuda_lib, "_PKG_DIR", tmp_path)
    with pytest.raises(DeviceError, match=r"libpdxfer_native_cuda.so is not built; build it with "
                                          r"bash native/build.sh --cuda"):
        cuda_lib.find_library()
    monkeypatch.setenv("PDXFER_NATIVE_CUDA_LIB", str(tmp_path / "nowhere.so"))
    with pytest.raises(DeviceError, match=r"nowhere.so does not exist; build it with bash native/build.sh --cuda"):
        cuda_lib.open_library(cuda_lib.find_library())


def test_a_cuda_library_older_than_its_sources_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("PDXFER_NATIVE_CUDA_LIB", raising=False)
    (tmp_path / "pkg" / "_native").mkdir(parents=True)
    (tmp_path / "native").mkdir()
    lib = tmp_path / "pkg" / "_native" / cuda_lib.LIB_NAME
    lib.write_bytes(b"")
    src = tmp_path / "native" / "pdx_cuda.cu"
    src.write_text("// newer")
    os.utime(lib, (1000, 1000))
    monkeypatch.setattr(cuda_lib, "_PKG_DIR", tmp_path / "pkg")
    monkeypatch.setattr(cuda_lib, "_SRC_DIR", tmp_path / "native")
    with pytest.raises(DeviceError, match=r"is older than native/pdx_cuda.cu; rebuild it with bash native/build.sh"):
        cuda_lib.find_library()
    os.utime(lib, None)
    os.utime(src, (1000, 1000))
    assert cuda_lib.find_library() == lib


def test_a_library_that_is_not_the_cuda_kernels_is_refused():
    cpu_lib = native.library_path()
    if cpu_lib is None:
        pytest.skip(f"no CPU native library: {native.backend_reason()}")
    with pytest.raises(DeviceError, match=r"is not pdxfer's CUDA kernel library: it lacks pdx_cuda_abi_version"):
        cuda_lib.open_library(Path(cpu_lib))
    junk = Path(cpu_lib).parent / "not-a-library.txt"
    try:
        junk.write_text("hello")
        with pytest.raises(DeviceError, match="cannot load the CUDA kernel library"):
            cuda_lib.open_library(junk)
    finally:
        junk.unlink(missing_ok=True)


def _nvcc() -> str | None:
    for p in (shutil.which("nvcc"), os.path.join(sys.prefix, "bin", "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if p and os.path.isfile(p):
            return p
    return None


@pytest.fixture(scope="module")
def built_cuda_lib(tmp_path_factory) -> Path:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc to build the CUDA twins")
    out = tmp_path_factory.mktemp("cudalib")
    res = subprocess.run(["bash", str(REPO / "native" / "build.sh"), "--cuda"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, NVCC=nvcc, PDXFER_NATIVE_OUT=str(out)))
    assert res.returncode == 0, res.stderr[-2000:]
    return out / cuda_lib.LIB_NAME


def test_the_built_cuda_library_opens_with_its_abi_version(built_cuda_lib, monkeypatch):
    lib = cuda_lib.open_library(built_cuda_lib)  # dlopen needs no GPU; launching would
    assert lib.pdx_cuda_abi_version() == native.ABI_VERSION
    monkeypatch.setenv("PDXFER_NATIVE_CUDA_LIB", str(built_cuda_lib))
    cuda_lib.reset()
    try:
        assert cuda_lib.cuda_library() is cuda_lib.cuda_library()  # opened once
    finally:
        cuda_lib.reset()
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    with pytest.raises(DeviceError, match=rf"has ABI version {native.ABI_VERSION - 1}, this pdxfer needs "
                                          rf"{native.ABI_VERSION}; rebuild"):
        cuda_lib.open_library(built_cuda_lib)


def test_run_arrays_match_the_c_structs_the_cuda_kernels_read():
    # The launches pass run arrays as raw memory: an [n, 3] / [n, 8] int64 row must be one
    # pdx_run / pdx_tok_run, field for field.
    import ctypes

    from pdxfer.kv.blockgeom import TOK_RUN_FIELDS

    class Run(ctypes.Structure):
        _fields_ = [(f, ctypes.c_int64) for f in ("src_off", "dst_off", "len")]

    class TokRun(ctypes.Structure):
        _fields_ = [(f, ctypes.c_int64) for f in TOK_RUN_FIELDS]

    header = (REPO / "native" / "pdx_native.h").read_text()
    tok = header[header.index("typedef struct {\n    int64_t src_off;\n    int64_t dst_off;\n    int64_t src_tok"):]
    tok = tok[: tok.index("} pdx_tok_run;")]
    assert [line.split()[1].rstrip(";") for line in tok.splitlines()[1:]] == list(TOK_RUN_FIELDS)
    arr = np.arange(16, dtype=np.int64).reshape(2, 8)
    got = (TokRun * 2).from_buffer_copy(arr.tobytes())
    assert [getattr(got[1], f) for f in TOK_RUN_FIELDS] == list(range(8, 16))
    assert ctypes.sizeof(Run) == 3 * 8 and ctypes.sizeof(TokRun) == 8 * 8


class _FakeTorchStream:
    cuda_stream = 0  # the default stream's handle: what a launch without a GPU is given


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.fail: str | None = None

    def record(self, _stream) -> None:
        pass

    def query(self) -> bool:
        if self.fail:
            raise RuntimeError(self.fail)
        return self.done


def _bare_cuda_device(monkeypatch, lib=None):
    """A CudaDevice past its CUDA check, its tensors on the host: what the bookkeeping and the
    ctypes launch code do can be checked without a GPU (a launch then fails with PDX_ECUDA)."""
    from pdxfer.device import cuda as cuda_mod

    dev = object.__new__(cuda_mod.CudaDevice)
    dev.index, dev.device, dev._torch_device = 0, "cuda:0", torch.device("cpu")
    dev._lib, dev._wrappers, dev._wrappers_lock = lib, {}, threading.Lock()
    monkeypatch.setattr(dev, "_flat", lambda *a, **kw: None)
    monkeypatch.setattr(dev, "_upload", lambda arr, s: torch.from_numpy(np.ascontiguousarray(arr)))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return dev, dev._wrap(_FakeTorchStream())


def test_cuda_work_keeps_what_it_uses_until_its_event_is_seen_complete(monkeypatch):
    import weakref

    dev, st = _bare_cuda_device(monkeypatch)
    used = torch.zeros(8, dtype=torch.uint8)
    gone = weakref.ref(used)
    st.keep(used)
    del used
    ev = dev.record_event(st)
    assert gone() is not None and st.take_refs() == []  # moved to the event, not left on the stream
    assert not ev.query() and gone() is not None  # the queued work may still read it
    t0 = time.monotonic()
    assert not ev.wait(0.05)  # bounded
    assert time.monotonic() - t0 < 0.5
    ev._event.done = True
    assert ev.wait(1.0) and ev.error is None
    assert gone() is None  # dropped once the event was seen complete
    assert dev._wrap(_FakeTorchStream()) is st  # one wrapper per stream: refs and events meet


def test_a_cuda_error_at_an_event_shows_on_its_error(monkeypatch):
    dev, st = _bare_cuda_device(monkeypatch)
    ev = dev.record_event(st)
    ev._event.fail = "CUDA error: an illegal memory access was encountered"
    assert ev.query() and ev.wait(0.0)
    assert ev.error == "cuda:0: CUDA error: an illegal memory access was encountered"


def test_a_failed_cuda_launch_raises_naming_the_kernel(monkeypatch, built_cuda_lib):
    """The real library, through the real ctypes signatures (geometries by value); with no GPU
    the launch itself fails, as a launch error on a GPU would."""
    dev, st = _bare_cuda_device(monkeypatch, cuda_lib.open_library(built_cuda_lib))
    src, dst = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(DeviceError, match=r"pdx_cuda_copy_runs on cuda:0 failed: CUDA launch error"):
        dev.copy_runs(src, dst, [[0, 0, 64]], st)
    geom = segment_geometry(describe(CPU, encode(CPU, torch.zeros(1, 2, 2, 4, 1, 2)), 4))
    with pytest.raises(DeviceError, match=r"pdx_cuda_scatter_tokens on cuda:0 failed: CUDA launch error"):
        dev.scatter_tokens(src, dst, geom, geom, [[0, 0, 0, 0, 4, 0, 0, 1]], st, elem_size=4)
    with pytest.raises(ValueError, match="writes past the end of dst"):  # checked before the library
        dev.copy_runs(src, dst, [[0, 250, 64]], st)
    assert len(st.take_refs()) == 6  # src, dst and the runs of each launch, until an event


# --------------------------------------------------------------------------- on a GPU (never run here)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU; the development machines have none")


@pytest.fixture
def gpu(built_cuda_lib, monkeypatch):
    from pdxfer.device.cuda import CudaDevice

    monkeypatch.setenv("PDXFER_NATIVE_CUDA_LIB", str(built_cuda_lib))
    cuda_lib.reset()
    yield CudaDevice(0)
    cuda_lib.reset()


def _copies_in_stream_order(ops) -> None:
    host = ops.alloc_host_pinned(1 << 20)
    host.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    a, b, back = ops.alloc(1 << 20), ops.alloc(1 << 20), ops.alloc_host_pinned(1 << 20)
    st = ops.new_stream()
    ops.copy(a, 0, host, 0, 1 << 20, st)
    ops.copy(b, 4096, a, 0, (1 << 20) - 4096, st)
    ops.copy(back, 0, b, 0, 1 << 20, st)
    ev = ops.record_event(st)
    assert ev.wait(WAIT) and ev.error is None
    assert torch.equal(back[4096:], host[: (1 << 20) - 4096])


def _bad_runs_raise_before_launch(ops, wrong_place: torch.Tensor, where_msg: str) -> None:
    src, dst = ops.alloc(128), ops.alloc(128)
    st = ops.new_stream()
    with pytest.raises(ValueError, match="writes past the end of dst"):
        ops.copy_runs(src, dst, [[0, 100, 64]], st)
    with pytest.raises(DeviceError, match=where_msg):
        ops.copy_runs(wrong_place, dst, [[0, 0, 64]], st)
    assert ops.record_event(st).wait(WAIT)


def test_the_gpu_copy_checks_run_on_the_async_stand_in(slow):
    """The bodies of the two CUDA tests below, through the asynchronous stand-in: their logic
    (stream order, the checks before a launch) is exercised where there is no GPU."""
    _copies_in_stream_order(slow)
    _bad_runs_raise_before_launch(slow, torch.zeros(128, dtype=torch.float32), "takes flat uint8 host tensors")


@needs_gpu
@pytest.mark.may_skip(reason="no CI machine has a GPU; bash scripts/test.sh gpu is the GPU check",
                      match=r"^needs a CUDA GPU")
def test_cuda_copies_between_pinned_host_and_device_memory_in_stream_order(gpu):
    _copies_in_stream_order(gpu)


@needs_gpu
@pytest.mark.may_skip(reason="no CI machine has a GPU; bash scripts/test.sh gpu is the GPU check",
                      match=r"^needs a CUDA GPU")
def test_cuda_bad_runs_raise_before_anything_is_launched(gpu):
    _bad_runs_raise_before_launch(gpu, torch.zeros(128, dtype=torch.uint8), "flat contiguous uint8 tensor on cuda:0")


def _staged_through(ops, where: str, case) -> torch.Tensor:
    """The reader's block bytes after a staged read of ``case`` (tests/unit/test_staging.py
    CASES) with staging and KV on ``where``, the READ played as ``ops.copy`` of each run from the
    holder's host memory, then scattered on the worker's stream."""
    src_fmt, dst_fmt, hb, lb, hr, hl, nheads, sh, dh = case
    g = torch.Generator().manual_seed(7)
    n_seq, start = 61, 5
    h_nb, l_nb = -(-n_seq // hb) + 2, -(-n_seq // lb) + 2
    hold = encode(src_fmt, torch.randn(2, 2, h_nb, hb, hr, 8, generator=g))
    hold_bytes = hold.view(torch.uint8).reshape(-1)
    phys = encode(dst_fmt, torch.randn(2, 2, l_nb, lb, hl, 8, generator=g)).to(where)
    rl = describe(src_fmt, hold, hb)
    h_blocks = [int(b) for b in torch.randperm(h_nb, generator=g)[: -(-n_seq // hb)]]
    l_blocks = [int(b) for b in torch.randperm(l_nb, generator=g)[: -(-n_seq // lb)]]
    read = (NodeRead("h", tuple(h_blocks), tuple(l_blocks)) if hb == lb else
            NodeRead("h", tuple(h_blocks[start // hb:]), tuple(l_blocks[start // lb:]), hb, start // hb * hb,
                     start // lb * lb, start, n_seq - start))
    cache = as_cache(phys)
    ll = describe_kv_caches(cache, block_size=lb, kv_format=dst_fmt)
    unit = -(-rl.bytes_per_block // 4096) * 4096
    staging = ReaderStaging(3 * unit, ll, region_tensors(cache, ll), ops=ops)  # several pieces
    assert staging.device == where
    planner = staging.planner_for(rl, staging_route(sh, dh, nheads))
    s = staging.stream(planner, read, "peer")
    copy_stream = ops.new_stream()
    while not s.finished:
        job = staging.next_piece(s)
        for r in job.plan.runs:
            ops.copy(staging._mem_t, r.local_offset, hold_bytes, r.remote_offset, r.nbytes, copy_stream)
        assert ops.record_event(copy_stream).wait(WAIT)
        if not staging.scatter(s):
            assert s.scatter_event.wait(WAIT)
            staging.finish_scatter(s)
    assert staging.area.in_use == 0
    return phys.cpu().view(torch.uint8)


@pytest.mark.parametrize("case", STAGING_CASES, ids=lambda c: f"{c[0]}{c[2]}-{c[1]}{c[3]}-h{c[6]}")
def test_the_gpu_staging_check_itself_runs_on_the_async_stand_in(slow, case):
    """The harness of the GPU test below, with the asynchronous stand-in in the GPU's place, so
    its logic is exercised where there is no GPU."""
    assert torch.equal(_staged_through(slow, "cpu", case), _staged_through(CpuStandIn(), "cpu", case))


@needs_gpu
@pytest.mark.may_skip(reason="no CI machine has a GPU; bash scripts/test.sh gpu is the GPU check",
                      match=r"^needs a CUDA GPU")
@pytest.mark.parametrize("case", STAGING_CASES, ids=lambda c: f"{c[0]}{c[2]}-{c[1]}{c[3]}-h{c[6]}")
def test_cuda_staging_scatter_gives_the_bytes_the_cpu_path_gives(gpu, case):
    """Staging in VRAM, pieces copied in from host memory (standing in for the READ), scattered
    by the CUDA twins on the worker's stream: the reader's blocks equal the CPU path's."""
    assert torch.equal(_staged_through(gpu, "cuda:0", case), _staged_through(CpuStandIn(), "cpu", case))
