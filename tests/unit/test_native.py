"""pdxfer.device.native kernels against a torch reference, on both backends (C++ library and torch path)."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_ref import (FORMATS, PAD_KEYS, apply_runs, encode, encode_padded, geometry, keep_disjoint, padded_geometry,
                        random_logical)

from pdxfer.kv import blockgeom as bg
from pdxfer.device import native

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int16, torch.int32]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["native", "native-stream", "torch"])
def backend(request, monkeypatch):
    kind = request.param.split("-")[0]
    monkeypatch.setenv("PDXFER_NATIVE", "1" if kind == "native" else "0")
    if kind == "native" and shutil.which("g++") is None:
        monkeypatch.setenv("PDXFER_NATIVE", "auto")
        if native.reload() != "native":
            pytest.skip("no g++ and no prebuilt library: " + native.backend_reason())
    assert native.reload() == kind
    # Split even tiny inputs over threads so the work partitioning is exercised too, and in the
    # -stream variant take the non-temporal store path that big transfers take.
    previous = native.set_tuning(1, 1 if request.param.endswith("stream") else 1 << 62)
    yield kind
    if previous is not None:
        native.set_tuning(*previous)
    monkeypatch.delenv("PDXFER_NATIVE")
    native.reload()


# --------------------------------------------------------------------------- copy_runs

@st.composite
def copy_case(draw):
    src_n = draw(st.integers(0, 600))
    dst_n = draw(st.integers(0, 600))
    runs, used = [], np.zeros(dst_n, dtype=bool)
    for _ in range(draw(st.integers(0, 12))):
        n = draw(st.integers(0, min(src_n, dst_n, 90)))
        so = draw(st.integers(0, src_n - n))
        do = draw(st.integers(0, dst_n - n))
        if used[do:do + n].any():  # concurrent runs must not write the same bytes
            continue
        used[do:do + n] = True
        runs.append((so, do, n))
    return src_n, dst_n, runs, draw(st.integers(1, 4))


@SETTINGS
@given(case=copy_case())
def test_copy_runs_equals_reference(backend, case):
    src_n, dst_n, runs, threads = case
    src = torch.randint(0, 256, (src_n,), dtype=torch.uint8)
    dst = torch.randint(0, 256, (dst_n,), dtype=torch.uint8)
    want = dst.clone()
    for so, do, n in runs:
        want[do:do + n] = src[so:so + n]
    native.copy_runs(src, dst, np.array(runs, dtype=np.int64).reshape(-1, 3), threads=threads)
    assert torch.equal(dst, want)


def test_copy_runs_large_and_raw_pointers(backend):
    # Runs above the per-thread threshold, addressed through RawBuffer, into shuffled slots.
    native.set_tuning(256 * 1024)
    n, size = 64, 32 * 1024
    src = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
    dst = torch.zeros(n * size, dtype=torch.uint8)
    perm = np.random.default_rng(1).permutation(n)
    runs = np.stack([np.arange(n) * size, perm * size, np.full(n, size)], axis=1)
    native.copy_runs(native.RawBuffer(src.data_ptr(), src.numel()),
                     native.RawBuffer(dst.data_ptr(), dst.numel()), runs, threads=3)
    assert torch.equal(dst.view(n, size)[torch.from_numpy(perm)], src.view(n, size))


def test_empty_run_lists_are_noops(backend):
    src, dst = torch.ones(8), torch.zeros(8)
    native.copy_runs(src, dst, [])
    native.copy_runs(src, dst, np.zeros((0, 3), dtype=np.int64))
    g = bg.nhd(2, 1, 4)
    native.scatter_tokens(src, dst, [], g, g)
    native.scatter_tokens(src, dst, [[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 2, 0, 0, 0]], g, g)
    assert not dst.any()


# --------------------------------------------------------------------------- scatter_tokens

@st.composite
def scatter_case(draw):
    parts = draw(st.sampled_from([1, 2]))
    fmts = [f for f, p in FORMATS.items() if p == parts]
    fs, fd = draw(st.sampled_from(fmts)), draw(st.sampled_from(fmts))
    bs, bd = draw(st.sampled_from([1, 2, 3, 4, 8, 16])), draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    hs, hd = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    d = draw(st.integers(1, 6))
    nbs, nbd = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    candidates: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(0, 10))):
        sb, db = draw(st.integers(0, nbs - 1)), draw(st.integers(0, nbd - 1))
        n = draw(st.integers(0, min(bs, bd)))
        stok, dtok = draw(st.integers(0, bs - n)), draw(st.integers(0, bd - n))
        nh = draw(st.integers(0, min(hs, hd)))
        sh, dh = draw(st.integers(0, hs - nh)), draw(st.integers(0, hd - nh))
        candidates.append((sb, db, stok, dtok, n, sh, dh, nh))
    dtype = draw(st.sampled_from(DTYPES))
    runs = keep_disjoint(nbd, bd, hd, candidates)
    return {"parts": parts, "fs": fs, "fd": fd, "bs": bs, "bd": bd, "hs": hs, "hd": hd, "d": d, "nbs": nbs,
            "nbd": nbd, "runs": runs, "dtype": dtype, "threads": draw(st.integers(1, 4)),
            "seed": draw(st.integers(0, 99))}


def run_scatter_case(c, *, src_as_bytes=False):
    src_l = random_logical(c["nbs"], c["parts"], c["bs"], c["hs"], c["d"], c["dtype"], c["seed"])
    dst_l = random_logical(c["nbd"], c["parts"], c["bd"], c["hd"], c["d"], c["dtype"], c["seed"] + 1)
    src, dst = encode(c["fs"], src_l), encode(c["fd"], dst_l)
    sg, s_stride = geometry(c["fs"], c["nbs"], c["bs"], c["hs"], c["d"])
    dg, d_stride = geometry(c["fd"], c["nbd"], c["bd"], c["hd"], c["d"])
    es = src.element_size()
    rows = [(sb * s_stride * es, db * d_stride * es, *rest) for sb, db, *rest in c["runs"]]
    apply_runs(src_l, dst_l, c["runs"])
    if src_as_bytes:  # a uint8 staging buffer adopts the element size of the other side
        src = src.view(torch.uint8)
    native.scatter_tokens(src, dst, np.array(rows, dtype=np.int64).reshape(-1, 8), sg, dg,
                          threads=c["threads"])
    assert torch.equal(dst.view(torch.uint8), encode(c["fd"], dst_l).view(torch.uint8))


@SETTINGS
@given(case=scatter_case())
def test_scatter_tokens_equals_reference(backend, case):
    run_scatter_case(case)


@SETTINGS
@given(case=scatter_case())
def test_scatter_from_byte_staging_buffer(backend, case):
    run_scatter_case(case, src_as_bytes=True)


@st.composite
def sequence_case(draw):
    """A token range of one sequence moved between block tables of different block sizes."""
    fs, fd = draw(st.sampled_from(["cpu", "flash_nhd", "flash_hnd"])), draw(st.sampled_from(["cpu", "flash_hnd"]))
    bs, bd = draw(st.sampled_from([1, 4, 8, 32, 64])), draw(st.sampled_from([2, 4, 16, 32, 128]))
    ntok = draw(st.integers(0, 200))
    s0, d0 = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    return (fs, fd, bs, bd, ntok, s0, d0, draw(st.sampled_from([torch.bfloat16, torch.float32])),
            draw(st.integers(0, 9)), draw(st.integers(1, 4)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sequence_case())
def test_token_runs_move_a_sequence_between_block_sizes(backend, case):
    fs, fd, bs, bd, ntok, s0, d0, dtype, seed, threads = case
    h, d = 2, 4
    nbs, nbd = (s0 + ntok) // bs + 2, (d0 + ntok) // bd + 2
    src_l = random_logical(nbs, 2, bs, h, d, dtype, seed)
    dst_l = random_logical(nbd, 2, bd, h, d, dtype, seed + 1)
    sg, s_stride = geometry(fs, nbs, bs, h, d)
    dg, d_stride = geometry(fd, nbd, bd, h, d)
    rng = np.random.default_rng(seed)
    s_table, d_table = rng.permutation(nbs), rng.permutation(nbd)  # scattered block tables
    es = torch.empty(0, dtype=dtype).element_size()
    runs = bg.token_runs(s_table * s_stride * es, bs, d_table * d_stride * es, bd, ntok,
                         src_start=s0, dst_start=d0, nheads=h)
    # Reference at the sequence level: flatten each table into [tokens, ...] and slice.
    s_seq = src_l[torch.from_numpy(s_table)].permute(1, 0, 2, 3, 4).reshape(2, -1, h, d)
    d_seq = dst_l[torch.from_numpy(d_table)].permute(1, 0, 2, 3, 4).reshape(2, -1, h, d).clone()
    d_seq[:, d0:d0 + ntok] = s_seq[:, s0:s0 + ntok]
    dst = encode(fd, dst_l)
    native.scatter_tokens(encode(fs, src_l), dst, runs, sg, dg, threads=threads)
    want_l = dst_l.clone()
    want_l[torch.from_numpy(d_table)] = d_seq.reshape(2, nbd, bd, h, d).permute(1, 0, 2, 3, 4)
    assert torch.equal(dst.view(torch.uint8), encode(fd, want_l).view(torch.uint8))
    assert len(runs) == 0 or runs[:, 4].sum() == ntok


def test_head_slice_of_cpu_blocks_into_smaller_tp_rank(backend):
    # Holder with 4 KV heads, reader rank owning heads 2..3 (TP 2), block 128 -> 64.
    src_l = random_logical(2, 2, 128, 4, 8, torch.bfloat16, 3)
    dst_l = random_logical(4, 2, 64, 2, 8, torch.bfloat16, 4)
    sg, s_stride = geometry("cpu", 2, 128, 4, 8)
    dg, d_stride = geometry("cpu", 4, 64, 2, 8)
    runs = bg.token_runs(np.arange(2) * s_stride * 2, 128, np.arange(4) * d_stride * 2, 64, 256,
                         src_head=2, dst_head=0, nheads=2)
    dst = encode("cpu", dst_l)
    native.scatter_tokens(encode("cpu", src_l), dst, runs, sg, dg)
    want = src_l[:, :, :, 2:4].reshape(2, 2, 2, 64, 2, 8).permute(0, 2, 1, 3, 4, 5).reshape(4, 2, 64, 2, 8)
    assert torch.equal(dst, encode("cpu", want))


# --------------------------------------------------------------------------- merged dims and long rows
# The kernel folds dims contiguous in both buffers (tokens x dim, heads x tokens x dim, K and V
# parts when adjacent) into as few, as long rows as it can. Padded layouts put one extra element
# (or a few) after a row, head, part or block on one side or both, so every fold is met both where
# it is right and one stride off where it is not; pads must stay untouched.

PADDED_DTYPES = [torch.int8, torch.int16, torch.bfloat16, torch.float32, torch.int64]  # 1, 2, 2, 4, 8 bytes


@st.composite
def pads_for(draw, kind):
    pads = dict.fromkeys(PAD_KEYS[kind], 0)
    key = draw(st.sampled_from([None, None, *PAD_KEYS[kind]]))  # none, or exactly one stride off
    if key is not None:
        pads[key] = draw(st.integers(1, 3))
    return pads


@st.composite
def padded_case(draw):
    kind_s = draw(st.sampled_from(["cpu", "hnd", "nhd", "ilv"]))
    parts = 2 if kind_s == "cpu" else draw(st.sampled_from([1, 2, 3]))  # 3: part spacing checked pairwise
    kinds = ["cpu", "hnd", "nhd", "ilv"] if parts == 2 else ["hnd", "nhd", "ilv"]
    kind_d = kind_s if draw(st.integers(0, 3)) else draw(st.sampled_from(kinds))  # mostly alike: merges
    pads_s = draw(pads_for(kind_s))
    pads_d = dict(pads_s) if kind_d == kind_s and draw(st.booleans()) else draw(pads_for(kind_d))
    bs = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    bd = bs if draw(st.booleans()) else draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    hs = draw(st.integers(1, 4))
    hd = hs if draw(st.booleans()) else draw(st.integers(1, 4))
    d = draw(st.integers(1, 8))
    nbs, nbd = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    candidates: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(0, 8))):
        sb, db = draw(st.integers(0, nbs - 1)), draw(st.integers(0, nbd - 1))
        mode = draw(st.sampled_from(["whole", "tokens", "heads", "any"]))
        top = min(bs, bd)
        if mode in ("whole", "heads"):  # every token of both blocks when the sizes agree
            n, stok, dtok = top, 0, 0
        else:
            n = draw(st.integers(0, top))
            stok, dtok = draw(st.integers(0, bs - n)), draw(st.integers(0, bd - n))
        if mode in ("whole", "tokens"):  # every head of both blocks when the counts agree
            nh, sh, dh = min(hs, hd), 0, 0
        else:
            nh = draw(st.integers(0, min(hs, hd)))
            sh, dh = draw(st.integers(0, hs - nh)), draw(st.integers(0, hd - nh))
        candidates.append((sb, db, stok, dtok, n, sh, dh, nh))
    runs = keep_disjoint(nbd, bd, hd, candidates)
    return {"kinds": (kind_s, kind_d), "pads": (pads_s, pads_d), "parts": parts, "bs": bs, "bd": bd, "hs": hs,
            "hd": hd, "d": d, "nbs": nbs, "nbd": nbd, "runs": runs, "dtype": draw(st.sampled_from(PADDED_DTYPES)),
            "threads": draw(st.integers(1, 4)), "seed": draw(st.integers(0, 99))}


def run_padded_case(c):
    (ks, kd), (ps, pd) = c["kinds"], c["pads"]
    src_l = random_logical(c["nbs"], c["parts"], c["bs"], c["hs"], c["d"], c["dtype"], c["seed"])
    dst_l = random_logical(c["nbd"], c["parts"], c["bd"], c["hd"], c["d"], c["dtype"], c["seed"] + 1)
    src, dst = encode_padded(ks, src_l, ps, fill=77), encode_padded(kd, dst_l, pd, fill=33)
    sg, s_stride = padded_geometry(ks, c["parts"], c["bs"], c["hs"], c["d"], ps)
    dg, d_stride = padded_geometry(kd, c["parts"], c["bd"], c["hd"], c["d"], pd)
    assert src.numel() == c["nbs"] * s_stride and dst.numel() == c["nbd"] * d_stride
    es = src.element_size()
    rows = [(sb * s_stride * es, db * d_stride * es, *rest) for sb, db, *rest in c["runs"]]
    native.scatter_tokens(src, dst, np.array(rows, dtype=np.int64).reshape(-1, 8), sg, dg, threads=c["threads"])
    apply_runs(src_l, dst_l, c["runs"])
    assert torch.equal(dst.view(torch.uint8), encode_padded(kd, dst_l, pd, fill=33).view(torch.uint8))


@SETTINGS
@given(case=padded_case())
def test_scatter_padded_layouts_equal_reference(backend, case):
    run_padded_case(case)


def _pads(kind, **kw):
    return {**dict.fromkeys(PAD_KEYS[kind], 0), **kw}


# Each fold, and the same layouts one stride off it, on purpose rather than by chance:
# (src kind, src pads, dst kind, dst pads, parts). The runs below include whole blocks, so every
# fold the two layouts allow happens.
EXPLICIT_LAYOUTS = {
    "cpu whole blocks: parts and heads fold to one row": ("cpu", {}, "cpu", {}, 2),
    "cpu K^T row padded on one side": ("cpu", {"kdim": 1}, "cpu", {}, 2),
    "cpu V row padded on one side": ("cpu", {}, "cpu", {"vtok": 1}, 2),
    "cpu gap between K and V on one side": ("cpu", {"gap": 1}, "cpu", {}, 2),
    "cpu gap between K and V on both sides": ("cpu", {"gap": 2}, "cpu", {"gap": 2}, 2),
    "cpu head padded on one side": ("cpu", {}, "cpu", {"head": 1}, 2),
    "hnd three parts evenly spaced": ("hnd", {}, "hnd", {}, 3),
    "hnd three parts, src unevenly spaced": ("hnd", {"gap0": 1}, "hnd", {}, 3),
    "hnd three parts, dst unevenly spaced": ("hnd", {}, "hnd", {"gap0": 1}, 3),
    "nhd three parts, both unevenly spaced": ("nhd", {"gap0": 2}, "nhd", {"gap0": 2}, 3),
    "nhd head padded on one side": ("nhd", {"head": 1}, "nhd", {}, 2),
    "nhd token padded on one side": ("nhd", {}, "nhd", {"tok": 1}, 2),
    "hnd token padded on one side": ("hnd", {"tok": 1}, "hnd", {}, 2),
    "interleaved parts into hnd: 4-dim transpose": ("ilv", {}, "hnd", {}, 2),
    "interleaved parts, no unit stride, into hnd: 4-dim element loop": ("ilv", {"inner": 1}, "hnd", {}, 2),
    "interleaved into interleaved, slot padded on one side": ("ilv", {}, "ilv", {"slot": 1}, 3),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.int16, torch.float32])
def test_scatter_folds_and_near_misses(backend, name, dtype):
    ks, ps, kd, pd, parts = EXPLICIT_LAYOUTS[name]
    b, h, d, nb = 4, 3, 5, 4
    runs = [(0, 1, 0, 0, b, 0, 0, h),  # whole block
            (1, 0, 0, 0, b, 1, 0, 2),  # whole tokens, a head slice
            (2, 2, 1, 0, 2, 0, 0, h),  # a token range, every head
            (3, 3, 1, 2, 2, 2, 1, 1)]  # a bit of everything
    case = {"kinds": (ks, kd), "pads": (_pads(ks, **ps), _pads(kd, **pd)), "parts": parts, "bs": b, "bd": b,
            "hs": h, "hd": h, "d": d, "nbs": nb, "nbd": nb, "runs": runs, "dtype": dtype, "threads": 2, "seed": 5}
    run_padded_case(case)


def test_padded_layouts_describe_the_plain_ones():
    """With no pads the padded encoder is the plain one (so the reference is the same reference)."""
    zero = {k: dict.fromkeys(v, 0) for k, v in PAD_KEYS.items()}
    x = random_logical(3, 2, 4, 3, 5, torch.float32, 0)
    assert torch.equal(encode_padded("ilv", x, zero["ilv"], 0), x.permute(0, 2, 3, 4, 1).contiguous().reshape(-1))
    for kind, fmt in (("cpu", "cpu"), ("hnd", "blocks_first_hnd"), ("nhd", "blocks_first")):
        g, stride = padded_geometry(kind, 2, 4, 3, 5, zero[kind])
        if fmt == "blocks_first_hnd":  # not a native_ref format: K then V, each HND
            assert torch.equal(encode_padded(kind, x, zero[kind], 0),
                               x.permute(0, 1, 3, 2, 4).contiguous().reshape(-1))
        else:
            assert torch.equal(encode_padded(kind, x, zero[kind], 0), encode(fmt, x))
            assert (g, stride) == geometry(fmt, 3, 4, 3, 5)


@st.composite
def long_rows_case(draw):
    """Blocks of realistic size, so merged rows run from ~1 KiB to 64 KiB and there are more of
    them than the row queue holds: sources in order (each row continues the last) or shuffled
    (each row jumps), head slices, sequences starting and ending inside blocks."""
    fs = draw(st.sampled_from(["cpu", "flash_hnd", "blocks_first", "flash_nhd"]))
    fd = fs if draw(st.integers(0, 2)) else draw(st.sampled_from(["cpu", "flash_hnd", "blocks_first"]))
    b = draw(st.sampled_from([16, 32, 64]))
    bd = b if draw(st.integers(0, 2)) else draw(st.sampled_from([16, 32, 64]))
    hs = draw(st.sampled_from([1, 2, 4]))
    nh = draw(st.sampled_from(sorted({1, hs // 2 or 1, hs})))
    sh = draw(st.integers(0, hs - nh))
    d = draw(st.sampled_from([33, 64]))  # 33: rows start off cache-line and 16-byte boundaries
    ntok = draw(st.integers(65 * b, 90 * b))
    s0, d0 = draw(st.sampled_from([0, 0, 5])), draw(st.sampled_from([0, 0, 3]))
    return {"fs": fs, "fd": fd, "bs": b, "bd": bd, "hs": hs, "nh": nh, "sh": sh, "d": d, "ntok": ntok,
            "s0": s0, "d0": d0, "dtype": draw(st.sampled_from([torch.bfloat16, torch.float32])),
            "shuffle_src": draw(st.booleans()), "threads": draw(st.integers(1, 4)), "seed": draw(st.integers(0, 9))}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=long_rows_case())
def test_long_rows_jumping_and_continuing_sources(backend, case):
    c = case
    bs, bd, hs, nh, d, ntok, s0, d0 = c["bs"], c["bd"], c["hs"], c["nh"], c["d"], c["ntok"], c["s0"], c["d0"]
    nbs, nbd = (s0 + ntok) // bs + 1, (d0 + ntok) // bd + 2
    src_l = random_logical(nbs, 2, bs, hs, d, c["dtype"], c["seed"])
    dst_l = random_logical(nbd, 2, bd, nh, d, c["dtype"], c["seed"] + 1)
    sg, s_stride = geometry(c["fs"], nbs, bs, hs, d)
    dg, d_stride = geometry(c["fd"], nbd, bd, nh, d)
    rng = np.random.default_rng(c["seed"])
    s_table = rng.permutation(nbs) if c["shuffle_src"] else np.arange(nbs)
    d_table = rng.permutation(nbd)
    es = torch.empty(0, dtype=c["dtype"]).element_size()
    runs = bg.token_runs(s_table * s_stride * es, bs, d_table * d_stride * es, bd, ntok, src_start=s0,
                         dst_start=d0, src_head=c["sh"], dst_head=0, nheads=nh)
    dst = encode(c["fd"], dst_l)
    native.scatter_tokens(encode(c["fs"], src_l), dst, runs, sg, dg, threads=c["threads"])
    s_seq = src_l[torch.from_numpy(s_table)].permute(1, 0, 2, 3, 4).reshape(2, -1, hs, d)
    d_seq = dst_l[torch.from_numpy(d_table)].permute(1, 0, 2, 3, 4).reshape(2, -1, nh, d).clone()
    d_seq[:, d0:d0 + ntok] = s_seq[:, s0:s0 + ntok, c["sh"]:c["sh"] + nh]
    want_l = dst_l.clone()
    want_l[torch.from_numpy(d_table)] = d_seq.reshape(2, nbd, bd, nh, d).permute(1, 0, 2, 3, 4)
    assert torch.equal(dst.view(torch.uint8), encode(c["fd"], want_l).view(torch.uint8))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), threads=st.integers(1, 4), shuffle_src=st.booleans())
def test_copy_runs_long_rows_at_odd_offsets(backend, seed, threads, shuffle_src):
    # 100 runs of 100 B - 20 KiB (most above the queueing threshold), odd offsets and lengths.
    rng = np.random.default_rng(seed)
    lens = rng.integers(100, 20 * 1024, 100)
    slot = int(lens.max()) + 7
    src = torch.randint(0, 256, (100 * slot,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(100 * slot + 3, dtype=torch.uint8)
    s_order = rng.permutation(100) if shuffle_src else np.arange(100)
    runs = np.stack([s_order * slot + rng.integers(0, 7, 100), rng.permutation(100) * slot + 3, lens], axis=1)
    want = dst.clone()
    for so, do, n in runs.tolist():
        want[do:do + n] = src[so:so + n]
    native.copy_runs(src, dst, runs, threads=threads)
    assert torch.equal(dst, want)


# --------------------------------------------------------------------------- bad input

def _bad_scatter_setup():
    g = bg.cpu_kv(4, 2, 3)
    src = torch.randn(3 * 2 * 2 * 4 * 3)  # three CPU blocks of 48 elements
    dst = torch.randn(2 * 2 * 2 * 4 * 3)
    return g, src, dst, 48 * 4


BAD_TOKEN_RUNS = {
    "src block past the end": ([3 * 192, 0, 0, 0, 1, 0, 0, 1], "past the end of src"),
    "dst block past the end": ([0, 2 * 192 - 4, 0, 0, 1, 0, 0, 1], "past the end of dst"),
    "tokens past src block": ([0, 0, 2, 0, 3, 0, 0, 1], "past the src block size"),
    "tokens past dst block": ([0, 0, 0, 3, 2, 0, 0, 1], "past the dst block size"),
    "heads past src": ([0, 0, 0, 0, 1, 1, 0, 2], "heads past src"),
    "heads past dst": ([0, 0, 0, 0, 1, 0, 2, 1], "heads past dst"),
    "negative ntok": ([0, 0, 0, 0, -1, 0, 0, 1], "negative ntok"),
    "negative offset": ([-192, 0, 0, 0, 1, 0, 0, 1], "negative block offset"),
    "misaligned offset": ([2, 0, 0, 0, 1, 0, 0, 1], "multiple of the element size"),
}


@pytest.mark.parametrize("name", sorted(BAD_TOKEN_RUNS))
def test_bad_token_run_raises_and_leaves_dst_untouched(backend, name):
    g, src, dst, _ = _bad_scatter_setup()
    row, msg = BAD_TOKEN_RUNS[name]
    before = dst.clone()
    good = [0, 0, 0, 0, 4, 0, 0, 2]  # a valid run ahead of the bad one must not be applied either
    with pytest.raises(ValueError, match=f"token run 1 .*{msg}"):
        native.scatter_tokens(src, dst, [good, row], g, g)
    assert torch.equal(dst, before)


@pytest.mark.parametrize("run, msg", [
    ((0, 0, 65), "reads past the end of src"),
    ((0, 10, 60), "writes past the end of dst"),
    ((-1, 0, 4), "negative offset"),
    ((0, 0, -4), "negative length"),
    ((2**62, 0, 2**62), "reads past the end"),  # would overflow a naive off + len
])
def test_bad_copy_run_raises_and_leaves_dst_untouched(backend, run, msg):
    src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"copy run 1 .*{msg}"):
        native.copy_runs(src, dst, [(0, 0, 8), run])
    assert not dst.any()


def test_mismatched_element_sizes_raise(backend):
    g = bg.nhd(2, 1, 4)
    run = [[0, 0, 0, 0, 2, 0, 0, 1]]
    src, dst = torch.ones(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="mismatched element size: src 2 bytes, dst 4 bytes"):
        native.scatter_tokens(src, dst, run, g, g)
    with pytest.raises(ValueError, match="mismatched element size: elem_size=4"):
        native.scatter_tokens(src, torch.zeros(8, dtype=torch.float16), run, g, g, elem_size=4)
    with pytest.raises(ValueError, match="element size must be"):
        native.scatter_tokens(native.RawBuffer(src.data_ptr(), 16), native.RawBuffer(dst.data_ptr(), 32),
                              run, g, g, elem_size=3)
    assert not dst.any()


def test_geometry_and_argument_errors(backend):
    with pytest.raises(ValueError, match="head_dim differs"):
        native.scatter_tokens(torch.ones(8), torch.zeros(8), [], bg.nhd(2, 1, 4), bg.nhd(4, 1, 2))
    with pytest.raises(ValueError, match="1 parts, dst has 2"):
        native.scatter_tokens(torch.ones(8), torch.zeros(8), [], bg.nhd(2, 1, 4), bg.cpu_kv(1, 1, 4))
    with pytest.raises(ValueError, match=r"shape \[n, 8\], got \[2, 3\]"):
        native.scatter_tokens(torch.ones(8), torch.zeros(8), [[0, 0, 0]] * 2, bg.nhd(2, 1, 4), bg.nhd(2, 1, 4))
    with pytest.raises(ValueError, match="not contiguous"):
        native.copy_runs(torch.ones(4, 4).t(), torch.zeros(16), [(0, 0, 4)])
    with pytest.raises(ValueError, match="block_tokens must be a positive int"):
        bg.nhd(0, 1, 1)


def test_c_library_checks_runs_itself():
    """Defense in depth: the C entry points refuse a bad run list without writing anything."""
    if native.active_backend() != "native":
        pytest.skip("native library unavailable: " + native.backend_reason())
    lib = ctypes.CDLL(native.library_path())
    lib.pdx_copy_runs.restype = ctypes.c_int
    src, dst = (ctypes.c_uint8 * 64)(*range(64)), (ctypes.c_uint8 * 64)()
    runs = np.array([[0, 0, 8], [60, 0, 8]], dtype=np.int64)
    bad = ctypes.c_int64()
    rc = lib.pdx_copy_runs(src, ctypes.c_int64(64), dst, ctypes.c_int64(64), ctypes.c_void_p(runs.ctypes.data),
                           ctypes.c_int64(2), 2, ctypes.byref(bad))
    assert (rc, bad.value) == (2, 1)
    assert bytes(dst) == bytes(64)


@pytest.mark.parametrize("fmt", ["cpu", "flash_nhd", "flash_hnd", "blocks_first_nhd"])
def test_segment_geometry_reads_vllm_shaped_tensors(backend, fmt):
    """Block 1 of a vLLM-shaped KV tensor, located by layout.py and read through blockgeom into NHD."""
    from pdxfer.kv import layout

    nb, b, h, d = 3, 4, 2, 8
    shape = {"cpu": (nb, h, b, 2 * d), "flash_nhd": (2, nb, b, h, d), "flash_hnd": (2, nb, h, b, d),
             "blocks_first_nhd": (nb, 2, b, h, d)}[fmt]
    t = torch.randn(shape).to(torch.bfloat16)
    # Block 1's K and V as [b, h, d], the way the attention backend reads them.
    if fmt == "cpu":
        per_head = t[1].reshape(h, 2, b * d)
        k = per_head[:, 0].view(h, d, b).permute(2, 0, 1)  # K stored transposed
        v = per_head[:, 1].view(h, b, d).transpose(0, 1)
    elif fmt == "flash_nhd":
        k, v = t[0, 1], t[1, 1]
    elif fmt == "flash_hnd":
        k, v = t[0, 1].transpose(0, 1), t[1, 1].transpose(0, 1)
    else:
        k, v = t[1, 0], t[1, 1]
    kv = layout.describe_kv_caches({"l0": t}, block_size=b, kv_format=fmt)
    g = bg.segment_geometry(kv)
    out = torch.zeros(2, b, h, d, dtype=torch.bfloat16)
    for i, seg in enumerate(kv.segments):  # one "kv" segment with two parts, or "k" and "v"
        dst_g = bg.kv_pair(bg.nhd(b, h, d), b * h * d) if len(g.parts) == 2 else bg.nhd(b, h, d, base=i * b * h * d)
        native.scatter_tokens(t.view(-1), out.view(-1), [[seg.block_offset(1), 0, 0, 0, b, 0, 0, h]], g, dst_g)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


# --------------------------------------------------------------------------- K^T <-> row-major tiles
# vLLM CPU's K is [D, B] per head (token fastest) and the flash layouts' K is dim fastest, so
# cpu <-> nhd/hnd swaps which dim is contiguous: the kernel transposes full V x V tiles in SSE
# registers (V = 8 for 1- and 2-byte elements, 4 for 4-byte; 8-byte elements go element by element)
# and the ragged edges element by element. Block sizes and head dims straddle the tile sizes (partial
# tiles on either edge), runs start inside blocks and take head slices, a stride can be one element
# off (tile rows then not 16-byte aligned: no non-temporal stores), and interleaved layouts (no
# unit stride on one side, or none at all) are near misses that must not take the tile path.

TILE_SIZES = [1, 3, 4, 7, 8, 9, 12, 16, 17, 24, 32, 33]


@st.composite
def transpose_case(draw):
    flash = draw(st.sampled_from(["nhd", "hnd", "ilv"]))
    kind_s, kind_d = ("cpu", flash) if draw(st.booleans()) else (flash, "cpu")
    pads_s, pads_d = draw(pads_for(kind_s)), draw(pads_for(kind_d))
    bs = draw(st.sampled_from(TILE_SIZES))
    bd = bs if draw(st.booleans()) else draw(st.sampled_from(TILE_SIZES))
    hs = draw(st.integers(1, 3))
    hd = hs if draw(st.booleans()) else draw(st.integers(1, 3))
    d = draw(st.sampled_from(TILE_SIZES))
    nbs, nbd = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    candidates: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, 6))):
        sb, db = draw(st.integers(0, nbs - 1)), draw(st.integers(0, nbd - 1))
        top = min(bs, bd)
        n = top if draw(st.booleans()) else draw(st.integers(0, top))
        stok, dtok = draw(st.integers(0, bs - n)), draw(st.integers(0, bd - n))
        nh = draw(st.integers(0, min(hs, hd)))
        sh, dh = draw(st.integers(0, hs - nh)), draw(st.integers(0, hd - nh))
        candidates.append((sb, db, stok, dtok, n, sh, dh, nh))
    runs = keep_disjoint(nbd, bd, hd, candidates)
    return {"kinds": (kind_s, kind_d), "pads": (pads_s, pads_d), "parts": 2, "bs": bs, "bd": bd, "hs": hs,
            "hd": hd, "d": d, "nbs": nbs, "nbd": nbd, "runs": runs, "dtype": draw(st.sampled_from(PADDED_DTYPES)),
            "threads": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 99))}


@SETTINGS
@given(case=transpose_case())
def test_cpu_flash_transposes_equal_reference(backend, case):
    run_padded_case(case)


# Named shapes: the bench's (block 16 and 64, head_dim 128), tiles exactly filling the block, one
# element short or over on each edge, and near misses.
TRANSPOSE_LAYOUTS = {
    "cpu -> nhd, whole tiles": ("cpu", {}, "nhd", {}, 16, 16),
    "nhd -> cpu, whole tiles": ("nhd", {}, "cpu", {}, 16, 16),
    "cpu -> hnd, whole tiles": ("cpu", {}, "hnd", {}, 16, 16),
    "hnd -> cpu, whole tiles": ("hnd", {}, "cpu", {}, 16, 16),
    "cpu -> nhd, block and dim one over a tile": ("cpu", {}, "nhd", {}, 17, 9),
    "hnd -> cpu, block and dim one short of a tile": ("hnd", {}, "cpu", {}, 15, 7),
    "cpu K^T rows padded -> nhd": ("cpu", {"kdim": 1}, "nhd", {}, 16, 16),
    "nhd -> cpu K^T rows padded (unaligned tile rows)": ("nhd", {}, "cpu", {"kdim": 1}, 16, 16),
    "cpu -> hnd token padded (unaligned tile rows)": ("cpu", {}, "hnd", {"tok": 1}, 8, 24),
    "cpu -> interleaved: no unit stride in dst": ("cpu", {}, "ilv", {}, 16, 16),
    "interleaved, no unit stride -> cpu": ("ilv", {"inner": 1}, "cpu", {}, 16, 16),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSE_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.int64])
def test_cpu_flash_transpose_shapes(backend, name, dtype):
    ks, ps, kd, pd, b, d = TRANSPOSE_LAYOUTS[name]
    h, nb = 3, 3
    runs = [(0, 1, 0, 0, b, 0, 0, h),  # whole block
            (1, 0, 0, 0, b, 1, 0, 2),  # whole tokens, a head slice
            (2, 2, 1, 0, b - 1, 0, 0, 1),  # a token range starting inside the block
            (2, 2, 0, b - 1, 1, 2, 2, 1)]  # one token
    case = {"kinds": (ks, kd), "pads": (_pads(ks, **ps), _pads(kd, **pd)), "parts": 2, "bs": b, "bd": b,
            "hs": h, "hd": h, "d": d, "nbs": nb, "nbd": nb, "runs": runs, "dtype": dtype, "threads": 2, "seed": 7}
    run_padded_case(case)


@pytest.mark.parametrize("src_kind,dst_kind", [("cpu", "nhd"), ("nhd", "cpu"), ("cpu", "hnd"), ("hnd", "cpu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,d", [(64, 128), (32, 136), (24, 100), (16, 128)])
def test_cpu_flash_bench_shapes(backend, src_kind, dst_kind, dtype, b, d):
    """The benchmark's geometry (head_dim 128, 8 heads, block 64) through the library's public entry, and
    head dims that leave bands over after the 64-byte groups a flash NHD -> cpu transpose stages
    (source rows >= 1 KiB apart: only with many heads x dims)."""
    h = 8
    run_padded_case({"kinds": (src_kind, dst_kind), "pads": (_pads(src_kind), _pads(dst_kind)), "parts": 2,
                     "bs": b, "bd": b, "hs": h, "hd": h, "d": d, "nbs": 2, "nbd": 2,
                     "runs": [(0, 1, 0, 0, b, 0, 0, h), (1, 0, b // 8, 0, b - b // 4, 2, 0, 5)], "dtype": dtype,
                     "threads": 2, "seed": 3})
