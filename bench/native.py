"""Native scatter/repack throughput vs a plain memcpy of the same bytes and vs the torch path.

Each case moves ~128 MiB (default) of KV blocks (bf16; two cpu <-> flash cases fp32) from a staging
buffer into shuffled blocks of a destination cache through ``pdxfer.device.native``; in the same run,
interleaved per repeat:

* memcpy: one ``ctypes.memmove`` of the same number of bytes between two contiguous buffers
  (also one torch ``copy_`` of the same size, reported alongside);
* native: ``pdxfer.device.native`` with the C++ library, for each ``--threads`` value;
* torch: the same call with ``PDXFER_NATIVE=0`` (one strided ``copy_`` per run and part).

Medians of ``--repeats`` timed runs after one untimed warm-up per method. The native output is
checked byte-for-byte against the torch path's. Target (issue 11): native >= 0.7x memcpy and
>= 2x torch.

    python bench/native.py --cpus 1 [--threads 1,2] [--repeats 9] [--mib 128] [--only TEXT] [--json PATH]

``--cpus`` pins the process (as ``taskset -c`` would). The kernel runs at most as many OS threads as
CPUs it may use, so with one CPU ``--threads 2`` cuts the work in two shards run by one thread.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from pdxfer.kv import blockgeom as bg
from pdxfer.device import native

DTYPE = torch.bfloat16
ES = 2
# Flash caches are [2, num_blocks, ...]: V sits one whole K tensor after K. The bench's flash
# destinations (and sources) are that, with `nb` blocks per K tensor.
FLASH = ("nhd", "hnd")


@dataclass
class Case:
    name: str
    src: torch.Tensor
    dst: torch.Tensor
    runs: np.ndarray
    src_geom: bg.BlockGeometry
    dst_geom: bg.BlockGeometry
    nbytes: int  # bytes actually moved


def _buffers(src_elems: int, dst_elems: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Filled (not empty) so every page is touched before timing: first writes cost ~10x here.
    return torch.randn(src_elems).to(dtype), torch.zeros(dst_elems, dtype=dtype)


def _geom(kind: str, b: int, heads: int, head_dim: int, nblocks: int, kv: bool) -> tuple[bg.BlockGeometry, int]:
    """Geometry and elements per block (per K block for a flash K+V pair) of one side."""
    if kind == "cpu":
        return bg.cpu_kv(b, heads, head_dim), 2 * b * heads * head_dim
    inner = (bg.nhd if kind == "nhd" else bg.hnd)(b, heads, head_dim)
    per = b * heads * head_dim
    return (bg.kv_pair(inner, nblocks * per) if kv else inner), per


def seq_case(name: str, src_kind: str, dst_kind: str, bs: int, bd: int, heads_src: int, heads_dst: int,
             head_dim: int, ntokens: int, src_head: int = 0, nheads: int | None = None, seed: int = 0,
             dtype: torch.dtype = DTYPE) -> Case:
    """Tokens [0, ntokens) of one sequence: staging blocks in order -> shuffled destination blocks.

    A cpu side carries K and V, so a flash side facing it is a K+V pair ([2, num_blocks, ...]);
    between two flash kinds only K moves (as in the existing NHD <-> HND cases)."""
    nheads = heads_dst if nheads is None else nheads
    es = torch.empty((), dtype=dtype).element_size()
    kv = "cpu" in (src_kind, dst_kind)
    nbs, nbd = -(-ntokens // bs), -(-ntokens // bd)
    sg, per_src = _geom(src_kind, bs, heads_src, head_dim, nbs, kv)
    dg, per_dst = _geom(dst_kind, bd, heads_dst, head_dim, nbd, kv)
    src_elems = nbs * per_src * (2 if kv and src_kind in FLASH else 1)
    dst_elems = nbd * per_dst * (2 if kv and dst_kind in FLASH else 1)
    src, dst = _buffers(src_elems, dst_elems, dtype)
    table = np.random.default_rng(seed).permutation(nbd)
    runs = bg.token_runs(np.arange(nbs) * per_src * es, bs, table * per_dst * es, bd, ntokens,
                         src_head=src_head, nheads=nheads)
    moved = ntokens * nheads * head_dim * es * len(sg.parts)
    return Case(name, src, dst, runs, sg, dg, moved)


def cases(mib: int) -> list[partial[Case]]:
    # 32 KiB blocks: CPU layout with 2 KV heads x 64 dims x 64 tokens (K and V), or a flash K part
    # with 8 heads x 128 dims x 16 tokens. `mib` sets the total (128 MiB = 4096 blocks of 32 KiB);
    # the cpu <-> flash cases move K and V of t_nhd / 2 tokens (bf16) or t_nhd / 4 (fp32): also `mib`.
    # Built one at a time, when measured (each holds ~2 x `mib` of buffers).
    blocks = mib * 32
    t_cpu = blocks * 64  # tokens whose CPU-layout KV (2 heads, dim 64) is `mib` MiB
    t_nhd = blocks * 16
    return [
        partial(seq_case, f"cpu same block size 64 ({blocks} x 32 KiB)", "cpu", "cpu", 64, 64, 2, 2, 64, t_cpu),
        partial(seq_case, "NHD -> HND (block 16, 8 heads x 128)", "nhd", "hnd", 16, 16, 8, 8, 128, t_nhd),
        partial(seq_case, "HND -> NHD (block 16, 8 heads x 128)", "hnd", "nhd", 16, 16, 8, 8, 128, t_nhd),
        partial(seq_case, "cpu block 128 -> 64", "cpu", "cpu", 128, 64, 2, 2, 64, t_cpu),
        partial(seq_case, "cpu block 64 -> 256", "cpu", "cpu", 64, 256, 2, 2, 64, t_cpu),
        partial(seq_case, "cpu block 256 -> 32", "cpu", "cpu", 256, 32, 2, 2, 64, t_cpu),
        partial(seq_case, "cpu head slice 2 of 4 heads (block 64)", "cpu", "cpu", 64, 64, 4, 2, 64, t_cpu // 2,
                 src_head=2, nheads=2),
        # vLLM CPU blocks <-> flash K+V caches: K is transposed on the way ([D, B] <-> [B, D]), V
        # is row-major on both sides. 8 heads x 128 dims, K and V: block 16 = 64 KiB per block.
        partial(seq_case, "cpu -> flash NHD (block 16, 8 x 128)", "cpu", "nhd", 16, 16, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "flash NHD -> cpu (block 16, 8 x 128)", "nhd", "cpu", 16, 16, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "cpu -> flash HND (block 16, 8 x 128)", "cpu", "hnd", 16, 16, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "flash HND -> cpu (block 16, 8 x 128)", "hnd", "cpu", 16, 16, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "cpu -> flash NHD (block 64, 8 x 128)", "cpu", "nhd", 64, 64, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "flash NHD -> cpu (block 64, 8 x 128)", "nhd", "cpu", 64, 64, 8, 8, 128, t_nhd // 2),
        partial(seq_case, "cpu -> flash NHD (block 16, 8 x 128, fp32)", "cpu", "nhd", 16, 16, 8, 8, 128, t_nhd // 4,
                 dtype=torch.float32),
        partial(seq_case, "flash NHD -> cpu (block 16, 8 x 128, fp32)", "nhd", "cpu", 16, 16, 8, 8, 128, t_nhd // 4,
                 dtype=torch.float32),
    ]


def _use(backend: str) -> None:
    os.environ["PDXFER_NATIVE"] = "1" if backend == "native" else "0"
    assert native.reload() == backend, native.backend_reason()


def measure(case: Case, threads: list[int], repeats: int) -> dict:
    n = case.nbytes
    a, b = torch.empty(n, dtype=torch.uint8).fill_(1), torch.zeros(n, dtype=torch.uint8)
    methods: dict[str, Callable[[], None]] = {
        "memcpy": lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), n),
        "torch_copy": lambda: b.copy_(a),
        "torch_path": lambda: native.scatter_tokens(case.src, case.dst, case.runs, case.src_geom, case.dst_geom),
    }
    for t in threads:
        methods[f"native_t{t}"] = (lambda t=t: native.scatter_tokens(
            case.src, case.dst, case.runs, case.src_geom, case.dst_geom, threads=t))
    times: dict[str, list[float]] = {k: [] for k in methods}

    def once(name: str) -> float:
        _use("torch" if name == "torch_path" else "native")
        t0 = time.perf_counter()
        methods[name]()
        return time.perf_counter() - t0

    for name in methods:  # warm-up, not counted
        once(name)
    _use("torch")
    case.dst.zero_()
    methods["torch_path"]()
    want = case.dst.clone()
    for _ in range(repeats):  # interleaved, so load changes hit every method alike
        for name in methods:
            times[name].append(once(name))
    case.dst.zero_()
    _use("native")
    methods[f"native_t{threads[0]}"]()
    if not torch.equal(case.dst.view(torch.uint8), want.view(torch.uint8)):
        raise SystemExit(f"{case.name}: native output differs from the torch path")
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"case": case.name, "bytes": n, "runs": len(case.runs),
           "median_s": med, "gbps": {k: n / v / 1e9 for k, v in med.items()}}
    row["ratios"] = {f"native_t{t}": {"vs_memcpy": med["memcpy"] / med[f"native_t{t}"],
                                      "vs_torch_path": med["torch_path"] / med[f"native_t{t}"]}
                     for t in threads}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="native thread counts, comma separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--mib", type=int, default=128, help="bytes moved per case")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--cpus", help="pin to these CPUs, comma separated (default: as started)")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(x) for x in args.cpus.split(",")})
    threads = [int(x) for x in args.threads.split(",")]
    torch.set_num_threads(1)
    _use("native")
    lib = native.library_path()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"pdxfer.device.native bench: {lib}; cpus {cpus}; native threads {threads}; "
          f"median of {args.repeats}, warm-up excluded; memcpy = ctypes.memmove of the same bytes")
    rows = []
    for make in cases(args.mib):
        if args.only and args.only not in make.args[0]:
            continue
        case = make()
        row = measure(case, threads, args.repeats)
        rows.append(row)
        g = row["gbps"]
        print(f"{case.name:42s} {row['bytes'] / 2**20:6.0f} MiB {row['runs']:6d} runs | memcpy {g['memcpy']:5.2f} "
              f"torch copy_ {g['torch_copy']:5.2f} torch path {g['torch_path']:5.2f} GB/s")
        for t in threads:
            r = row["ratios"][f"native_t{t}"]
            print(f"{'':42s} native threads={t}: {g[f'native_t{t}']:5.2f} GB/s = "
                  f"{r['vs_memcpy']:.2f}x memcpy, {r['vs_torch_path']:.2f}x torch path")
        del case
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpus": cpus, "threads": threads, "repeats": args.repeats, "mib": args.mib, "library": lib,
                "machine": platform.machine(), "torch": torch.__version__,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "loadavg": os.getloadavg()}
        args.json.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
