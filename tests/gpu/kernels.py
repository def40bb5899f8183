"""Check 1: the device kernels (copy_runs, scatter_tokens) against the torch reference.

Every case is built from tests/unit/native_ref.py's reference: KV as logical
``[blocks, parts, tokens, heads, dim]`` tensors, encoded into each physical layout with permutes,
the expected result computed by plain indexing. The kernels run through ``DeviceOps`` (a stream,
an event, a bounded wait) and their output is compared byte for byte with the reference.

Cases: every layout pair of bench/native.py (same parameters, at ``--mib``), then seeded random
scatters (plain and padded layouts), sequence moves between block sizes and byte copies, then
bad run lists, which must raise before anything is enqueued.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from bench import native as bench_native
from pdxfer.kv import blockgeom as bg
from tests.gpu.report import Report
from tests.gpu.target import Target, d2d_copy_seconds, first_difference, median_time, size_text
from tests.unit.native_ref import (
    FORMATS,
    PAD_KEYS,
    apply_runs,
    encode,
    encode_padded,
    geometry,
    keep_disjoint,
    padded_geometry,
    random_logical,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int16, torch.int32]
PADDED_DTYPES = [torch.int8, torch.int16, torch.bfloat16, torch.float32, torch.int64]
BLOCK_SIZES = [1, 2, 3, 4, 8, 16]
MAX_FAILS_SHOWN = 5


@dataclass
class Scatter:
    """One scatter_tokens call and its expected destination bytes."""

    name: str
    src: torch.Tensor  # flat uint8
    dst: torch.Tensor  # flat uint8, the initial destination (overwritten by the kernel)
    want: torch.Tensor  # flat uint8
    src_geom: bg.BlockGeometry
    dst_geom: bg.BlockGeometry
    runs: np.ndarray
    elem_size: int
    moved: int = 0  # bytes the runs move (for GB/s)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _logical(nb: int, parts: int, b: int, h: int, d: int, dtype: torch.dtype, seed: int,
             device: str) -> torch.Tensor:
    """Random logical KV made on ``device`` (bench-sized cases: generating 128 MiB on the CPU per
    case would dominate the run)."""
    if device == "cpu":
        return random_logical(nb, parts, b, h, d, dtype, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((nb, parts, b, h, d), generator=g, device=device).to(dtype)


def sequence_scatter(name: str, fs: str, fd: str, bs: int, bd: int, hs: int, hd: int, d: int, ntok: int,
                     dtype: torch.dtype, seed: int, device: str, *, s0: int = 0, d0: int = 0,
                     src_head: int = 0, dst_head: int = 0, nheads: int | None = None,
                     shuffle_src: bool = False, spare_blocks: int = 0) -> Scatter:
    """Tokens ``[s0, s0+ntok)`` of a sequence in ``fs`` blocks into ``[d0, ...)`` of shuffled ``fd``
    blocks; the reference works at the sequence level (flatten each block table and slice)."""
    nheads = hd if nheads is None else nheads
    parts = FORMATS[fs]
    nbs, nbd = -(-(s0 + ntok) // bs) + spare_blocks, -(-(d0 + ntok) // bd) + spare_blocks
    nbs, nbd = max(nbs, 1), max(nbd, 1)
    src_l = _logical(nbs, parts, bs, hs, d, dtype, seed, device)
    dst_l = _logical(nbd, parts, bd, hd, d, dtype, seed + 1, device)
    sg, s_stride = geometry(fs, nbs, bs, hs, d)
    dg, d_stride = geometry(fd, nbd, bd, hd, d)
    rng = np.random.default_rng(seed)
    s_table = rng.permutation(nbs) if shuffle_src else np.arange(nbs)
    d_table = rng.permutation(nbd)
    es = torch.empty(0, dtype=dtype).element_size()
    runs = bg.token_runs(s_table * s_stride * es, bs, d_table * d_stride * es, bd, ntok,
                         src_start=s0, dst_start=d0, src_head=src_head, dst_head=dst_head, nheads=nheads)
    st, dt = torch.from_numpy(s_table).to(device), torch.from_numpy(d_table).to(device)
    s_seq = src_l[st].permute(1, 0, 2, 3, 4).reshape(parts, -1, hs, d)
    d_seq = dst_l[dt].permute(1, 0, 2, 3, 4).reshape(parts, -1, hd, d).clone()
    d_seq[:, d0:d0 + ntok, dst_head:dst_head + nheads] = s_seq[:, s0:s0 + ntok, src_head:src_head + nheads]
    want_l = dst_l.clone()
    want_l[dt] = d_seq.reshape(parts, nbd, bd, hd, d).permute(1, 0, 2, 3, 4)
    moved = ntok * nheads * d * es * parts
    return Scatter(name, _flat(encode(fs, src_l)), _flat(encode(fd, dst_l)), _flat(encode(fd, want_l)),
                   sg, dg, runs, es, moved)


def _bench_format(kind: str, kv: bool) -> str:
    # bench/native.py's "nhd"/"hnd" sides are K+V flash caches ([2, num_blocks, ...]) when they face
    # a cpu side, a lone K otherwise: native_ref's flash_* and nhd/hnd formats.
    if kind == "cpu":
        return "cpu"
    return f"flash_{kind}" if kv else kind


def bench_scatters(mib: int, device: str) -> list[Callable[[], Scatter]]:
    """bench/native.py's cases (its parameters), rebuilt on the reference encoders."""
    out = []
    for make in bench_native.cases(mib):
        name, sk, dk, bs, bd, hs, hd, d, ntok = make.args
        kw: dict[str, Any] = dict(make.keywords)
        kv = "cpu" in (sk, dk)
        out.append(lambda name=name, sk=sk, dk=dk, bs=bs, bd=bd, hs=hs, hd=hd, d=d, ntok=ntok, kv=kv, kw=kw:
                   sequence_scatter(name, _bench_format(sk, kv), _bench_format(dk, kv), bs, bd, hs, hd, d, ntok,
                                    kw.get("dtype", bench_native.DTYPE), 0, device,
                                    src_head=kw.get("src_head", 0), nheads=kw.get("nheads")))
    return out


def _block_runs(r: random.Random, nbs: int, nbd: int, bs: int, bd: int, hs: int, hd: int,
                count: int) -> list[tuple[int, ...]]:
    cands = []
    for _ in range(count):
        sb, db = r.randrange(nbs), r.randrange(nbd)
        n = r.randint(0, min(bs, bd))
        stok, dtok = r.randint(0, bs - n), r.randint(0, bd - n)
        if r.random() < 0.3:  # whole heads: the folds the kernel makes when counts agree
            nh, sh, dh = min(hs, hd), 0, 0
        else:
            nh = r.randint(0, min(hs, hd))
            sh, dh = r.randint(0, hs - nh), r.randint(0, hd - nh)
        cands.append((sb, db, stok, dtok, n, sh, dh, nh))
    return keep_disjoint(nbd, bd, hd, cands)


def random_scatter(r: random.Random, i: int, device: str) -> Scatter:
    parts = r.choice([1, 2])
    fmts = sorted(f for f, p in FORMATS.items() if p == parts)
    fs, fd = r.choice(fmts), r.choice(fmts)
    bs, bd = r.choice(BLOCK_SIZES), r.choice(BLOCK_SIZES)
    hs, hd, d = r.randint(1, 4), r.randint(1, 4), r.randint(1, 6)
    nbs, nbd = r.randint(1, 5), r.randint(1, 5)
    runs = _block_runs(r, nbs, nbd, bs, bd, hs, hd, r.randint(0, 10))
    dtype, seed = r.choice(DTYPES), r.randrange(1000)
    src_l = random_logical(nbs, parts, bs, hs, d, dtype, seed)
    dst_l = random_logical(nbd, parts, bd, hd, d, dtype, seed + 1)
    src, dst = encode(fs, src_l), encode(fd, dst_l)
    sg, s_stride = geometry(fs, nbs, bs, hs, d)
    dg, d_stride = geometry(fd, nbd, bd, hd, d)
    es = src.element_size()
    rows = np.array([(sb * s_stride * es, db * d_stride * es, *rest) for sb, db, *rest in runs],
                    dtype=np.int64).reshape(-1, 8)
    apply_runs(src_l, dst_l, runs)
    name = f"random scatter #{i} {fs}->{fd} b{bs}->{bd} h{hs}->{hd} d{d} {dtype} {len(runs)} runs"
    return Scatter(name, _flat(src).to(device), _flat(dst).to(device), _flat(encode(fd, dst_l)).to(device),
                   sg, dg, rows, es)


def _pads(r: random.Random, kind: str) -> dict[str, int]:
    pads = dict.fromkeys(PAD_KEYS[kind], 0)
    key = r.choice([None, None, *PAD_KEYS[kind]])  # none, or exactly one stride off
    if key is not None:
        pads[key] = r.randint(1, 3)
    return pads


def random_padded(r: random.Random, i: int, device: str) -> Scatter:
    ks = r.choice(["cpu", "hnd", "nhd", "ilv"])
    parts = 2 if ks == "cpu" else r.choice([1, 2, 3])
    kinds = ["cpu", "hnd", "nhd", "ilv"] if parts == 2 else ["hnd", "nhd", "ilv"]
    kd = ks if r.randrange(4) else r.choice(kinds)  # mostly alike: that is where dims merge
    ps = _pads(r, ks)
    pd = dict(ps) if kd == ks and r.random() < 0.5 else _pads(r, kd)
    bs = r.choice(BLOCK_SIZES)
    bd = bs if r.random() < 0.5 else r.choice(BLOCK_SIZES)
    hs = r.randint(1, 4)
    hd = hs if r.random() < 0.5 else r.randint(1, 4)
    d, nbs, nbd = r.randint(1, 8), r.randint(1, 4), r.randint(1, 4)
    runs = _block_runs(r, nbs, nbd, bs, bd, hs, hd, r.randint(0, 8))
    dtype, seed = r.choice(PADDED_DTYPES), r.randrange(1000)
    src_l = random_logical(nbs, parts, bs, hs, d, dtype, seed)
    dst_l = random_logical(nbd, parts, bd, hd, d, dtype, seed + 1)
    src, dst = encode_padded(ks, src_l, ps, fill=77), encode_padded(kd, dst_l, pd, fill=33)
    sg, s_stride = padded_geometry(ks, parts, bs, hs, d, ps)
    dg, d_stride = padded_geometry(kd, parts, bd, hd, d, pd)
    es = src.element_size()
    rows = np.array([(sb * s_stride * es, db * d_stride * es, *rest) for sb, db, *rest in runs],
                    dtype=np.int64).reshape(-1, 8)
    apply_runs(src_l, dst_l, runs)
    name = f"random padded #{i} {ks}{ps}->{kd}{pd} parts {parts} {dtype} {len(runs)} runs"
    return Scatter(name, _flat(src).to(device), _flat(dst).to(device),
                   _flat(encode_padded(kd, dst_l, pd, fill=33)).to(device), sg, dg, rows, es)


def random_sequence(r: random.Random, i: int, device: str) -> Scatter:
    fs = r.choice(["cpu", "flash_nhd", "flash_hnd", "blocks_first"])
    fd = r.choice(["cpu", "flash_nhd", "flash_hnd", "blocks_first"])
    bs, bd = r.choice([1, 4, 8, 16, 32, 64]), r.choice([2, 4, 16, 32, 128])
    ntok, s0, d0 = r.randint(0, 300), r.randint(0, 40), r.randint(0, 40)
    dtype = r.choice([torch.bfloat16, torch.float32, torch.float16])
    return sequence_scatter(f"random sequence #{i} {fs}->{fd} b{bs}->{bd} {ntok} tokens from {s0} to {d0} {dtype}",
                            fs, fd, bs, bd, 2, 2, r.choice([4, 8, 64]), ntok, dtype, r.randrange(1000), device,
                            s0=s0, d0=d0, shuffle_src=True, spare_blocks=1)


CopyCase = tuple[str, torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor]  # name, src, dst, runs, want


def random_copy(r: random.Random, i: int, device: str) -> CopyCase:
    big = r.random() < 0.2  # some runs long enough to span many GPU thread blocks
    src_n, dst_n = r.randint(0, 1 << (20 if big else 10)), r.randint(0, 1 << (20 if big else 10))
    g = torch.Generator().manual_seed(r.randrange(1 << 30))
    src = torch.randint(0, 256, (src_n,), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (dst_n,), dtype=torch.uint8, generator=g)
    want, used = dst.clone(), np.zeros(dst_n, dtype=bool)
    runs = []
    for _ in range(r.randint(0, 16)):
        n = r.randint(0, min(src_n, dst_n, 1 << (18 if big else 7)))
        so, do = r.randint(0, src_n - n), r.randint(0, dst_n - n)
        if used[do:do + n].any():  # runs are copied concurrently: destinations must not overlap
            continue
        used[do:do + n] = True
        runs.append((so, do, n))
        want[do:do + n] = src[so:so + n]
    arr = np.array(runs, dtype=np.int64).reshape(-1, 3)
    return (f"random copy_runs #{i} {src_n}->{dst_n} bytes, {len(runs)} runs", src.to(device), dst.to(device),
            arr, want.to(device))


def _run_scatter(t: Target, stream: Any, c: Scatter, dst: torch.Tensor) -> None:
    t.ops.scatter_tokens(c.src, dst, c.src_geom, c.dst_geom, c.runs, stream, elem_size=c.elem_size)


def check_scatter(t: Target, stream: Any, c: Scatter, corrupt: bool = False) -> str | None:
    """None when the kernel's output equals the reference, else why not."""
    try:
        _run_scatter(t, stream, c, c.dst)
        t.finish(stream, c.name)
    except Exception as exc:  # noqa: BLE001 - any failure of the launch is this case's FAIL
        return f"{type(exc).__name__}: {exc}"
    if corrupt and c.dst.numel():  # --corrupt-for-test: prove a wrong byte is reported
        c.dst[c.dst.numel() // 2] ^= 0x5A
    if torch.equal(c.dst, c.want):
        return None
    return first_difference(c.dst, c.want)


def run_bench_cases(rep: Report, t: Target, mib: int, repeats: int, corrupt: bool) -> None:
    stream = t.ops.new_stream()
    for n, make in enumerate(bench_scatters(mib, t.device)):
        c = make()
        why = check_scatter(t, stream, c, corrupt=corrupt and n == 0)
        label = f"kernel {c.name}"
        if why:
            rep.failed(label, why)
            continue
        spare = c.dst.clone()
        secs = median_time(lambda: (_run_scatter(t, stream, c, spare), t.finish(stream, c.name)), t.sync, repeats)
        base = d2d_copy_seconds(t, c.moved, repeats)
        rep.passed(label, f"{size_text(c.moved)}, {len(c.runs)} runs, byte-equal; "
                          f"{c.moved / secs / 1e9:.2f} GB/s = {base / secs:.2f}x a torch copy_ of the same bytes "
                          f"({c.moved / base / 1e9:.2f} GB/s)")
        del c, spare


def run_random_cases(rep: Report, t: Target, seed: int, count: int) -> None:
    r = random.Random(seed)
    stream = t.ops.new_stream()
    groups: list[tuple[str, int, Callable[[random.Random, int, str], Scatter]]] = [
        ("random scatter_tokens (every format pair)", count, random_scatter),
        ("random scatter_tokens (padded layouts)", count, random_padded),
        ("random sequence moves between block sizes", max(1, count // 3), random_sequence),
    ]
    for title, n, make in groups:
        fails = []
        for i in range(n):
            c = make(r, i, t.device)
            why = check_scatter(t, stream, c)
            if why:
                fails.append(f"{c.name}: {why}")
        _group_result(rep, f"kernel {title}", n, fails, seed)
    fails = []
    n = max(1, count // 3)
    for i in range(n):
        name, src, dst, runs, want = random_copy(r, i, t.device)
        try:
            t.ops.copy_runs(src, dst, runs, stream)
            t.finish(stream, name)
        except Exception as exc:  # noqa: BLE001 - a failed launch is this case's FAIL
            fails.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not torch.equal(dst, want):
            fails.append(f"{name}: {first_difference(dst, want)}")
    _group_result(rep, "kernel random copy_runs", n, fails, seed)


def _group_result(rep: Report, title: str, n: int, fails: list[str], seed: int) -> None:
    if not fails:
        rep.passed(title, f"{n} cases byte-equal to the reference (seed {seed})")
        return
    rep.failed(title, f"{len(fails)} of {n} cases differ (seed {seed})")
    for f in fails[:MAX_FAILS_SHOWN]:
        rep.info(f)


def run_bad_runs(rep: Report, t: Target) -> None:
    """Bad run lists must raise at the call, before anything is enqueued: the device kernels do
    no bounds checks, so a launch would write outside the buffer."""
    stream = t.ops.new_stream()
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8).to(t.device)
    g = bg.nhd(4, 2, 8)  # 64 elements per block
    cases: list[tuple[str, Callable[[torch.Tensor], None]]] = [
        ("copy run writing past the end of dst",
         lambda dst: t.ops.copy_runs(src, dst, [[0, 0, 16], [0, 250, 16]], stream)),
        ("copy run with a negative length", lambda dst: t.ops.copy_runs(src, dst, [[0, 0, -1]], stream)),
        ("token run past the source block size",
         lambda dst: t.ops.scatter_tokens(src, dst, g, g, [[0, 0, 2, 0, 3, 0, 0, 1]], stream, elem_size=1)),
        ("token run touching dst past its end",
         lambda dst: t.ops.scatter_tokens(src, dst, g, g, [[0, 0, 0, 0, 4, 0, 0, 2], [0, 224, 0, 0, 4, 0, 0, 2]],
                                          stream, elem_size=1)),
    ]
    for name, call in cases:
        dst = torch.zeros(256, dtype=torch.uint8, device=t.device)
        try:
            call(dst)
        except Exception as exc:  # noqa: BLE001 - the type is reported; any refusal at the call counts
            t.finish(stream, name)
            untouched = not bool(dst.any())
            rep.check(f"kernel bad run list refused: {name}", untouched,
                      f"{type(exc).__name__} before launch" if untouched else
                      f"{type(exc).__name__} raised, but dst was written anyway")
            continue
        t.finish(stream, name)
        rep.failed(f"kernel bad run list refused: {name}", "the call enqueued it without raising")


def run_copies(rep: Report, t: Target, seed: int) -> None:
    """``DeviceOps.copy`` at odd offsets in every direction the bounce buffers and staging use:
    device -> pinned host -> device, and device -> device, on one stream in order."""
    n = 3 * (1 << 20) + 77
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    stream = t.ops.new_stream()
    try:
        dev = t.ops.alloc(n + 64)
        host = t.ops.alloc_host_pinned(n + 64)
        dev2 = t.ops.alloc(n + 64)
        dev[5:5 + n].copy_(data.to(t.device))
        t.sync()
        t.ops.copy(host, 11, dev, 5, n, stream)  # device -> pinned host
        t.ops.copy(dev2, 3, host, 11, n, stream)  # pinned host -> device, queued behind it
        t.ops.copy(dev, 40, dev2, 3, 1000, stream)  # device -> device
        t.finish(stream, "copies")
    except Exception as exc:  # noqa: BLE001 - any failure is this check's FAIL
        rep.failed("device copy host <-> device <-> device", f"{type(exc).__name__}: {exc}")
        return
    got_host = host[11:11 + n].cpu()
    got_dev2 = dev2[3:3 + n].cpu()
    got_dev = dev[40:1040].cpu()
    why = next((f"{name}: {first_difference(got, want)}" for name, got, want in (
        ("pinned host", got_host, data), ("device after host round trip", got_dev2, data),
        ("device to device", got_dev, data[:1000])) if not torch.equal(got, want)), None)
    rep.check("device copy host <-> device <-> device", why is None,
              why or f"{size_text(n)} at odd offsets, three copies queued on one stream, byte-equal")
