"""Transfer-plan size and build time: coalesced vs one run per (layer, block).

Scenario (issue 2): 128 chunks of 256 tokens of a 32-layer model with vLLM's CPU layout
(block size 128, so 2 blocks per chunk), holder and reader block tables mostly consecutive
(a few fragmentation breaks). The baseline is the uncoalesced plan, built in the same run:
the descriptor count NixlConnector-style per-block descriptors would post. The same read over
a block-outermost cache (vLLM's BLHNC on CUDA) is printed next to it: one run per run of
consecutive blocks, asserted.

    python bench/plan.py [--json out/plan.json] [--breaks 8] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pdxfer.kv.layout import CPU, KV_HNC, KVLayout, Region, Segment
from pdxfer.planning.peer_plan import build_plan
from pdxfer.kv.chunks import blocks_for_chunks


def synthetic_layout(layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     blocks_outer: bool = False) -> KVLayout:
    """All layers in one allocation: layer-outermost as vLLM's CPU backend allocates it, or
    block-outermost (vLLM's BLHNC on CUDA: one block of every layer is adjacent)."""
    block_bytes = kv_heads * block_size * 2 * head_dim * 2  # bf16
    if blocks_outer:
        segs = tuple(Segment(f"model.layers.{i}.self_attn", "kv", 0, i * block_bytes, layers * block_bytes,
                             block_bytes) for i in range(layers))
    else:
        segs = tuple(Segment(f"model.layers.{i}.self_attn", "kv", 0, i * num_blocks * block_bytes, block_bytes,
                             block_bytes) for i in range(layers))
    return KVLayout(KV_HNC if blocks_outer else CPU, "bfloat16", num_blocks, block_size, kv_heads, head_dim,
                    (Region(0, layers * num_blocks * block_bytes),), segs)


def block_runs(remote: list[int], local: list[int]) -> int:
    """How many runs of block ids consecutive on both sides the pairs form."""
    return 1 + sum(1 for i in range(1, len(remote)) if (remote[i] - remote[i - 1], local[i] - local[i - 1]) != (1, 1))


def mostly_consecutive(n: int, start: int, breaks: int, rng: random.Random) -> list[int]:
    """n block ids counting up from start, with `breaks` jumps (allocator fragmentation)."""
    cuts = set(rng.sample(range(1, n), breaks)) if breaks else set()
    out, b = [], start
    for i in range(n):
        if i in cuts:
            b += rng.randrange(2, 9)
        out.append(b)
        b += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--breaks", type=int, default=8, help="discontinuities in each block table")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    rng = random.Random(0)
    nblocks = blocks_for_chunks(args.chunks, args.chunk_tokens, args.block_size)
    layout = synthetic_layout(args.layers, 4 * nblocks + 200, args.block_size, 8, 128)
    remote = mostly_consecutive(nblocks, 17, args.breaks, rng)
    local = mostly_consecutive(nblocks, 3, args.breaks, rng)

    def timed(coalesce: bool, lay: KVLayout = layout) -> tuple[int, float, int]:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = build_plan(lay, remote, lay, local, coalesce_runs=coalesce)
            times.append(time.perf_counter() - t0)
        return len(plan), statistics.median(times) * 1e3, plan.total_bytes

    base_runs, base_ms, nbytes = timed(False)
    runs, ms, nbytes2 = timed(True)
    assert nbytes == nbytes2
    row = {
        "chunks": args.chunks, "layers": args.layers, "blocks": nblocks, "bytes": nbytes,
        "uncoalesced_runs": base_runs, "coalesced_runs": runs, "run_ratio": runs / base_runs,
        "uncoalesced_build_ms_p50": base_ms, "coalesced_build_ms_p50": ms,
        "avg_run_bytes": nbytes / runs,
    }
    print(f"{args.chunks} chunks x {args.layers} layers, {nblocks} blocks/side, {nbytes / 2**20:.1f} MiB, "
          f"{args.breaks} breaks per block table")
    print(f"  uncoalesced (baseline): {base_runs:6d} runs  build p50 {base_ms:7.2f} ms")
    print(f"  coalesced (pdxfer)   : {runs:6d} runs  build p50 {ms:7.2f} ms  "
          f"ratio {runs / base_runs:.4f} ({base_runs / runs:.0f}x fewer descriptors, "
          f"avg run {nbytes / runs / 2**10:.0f} KiB)")
    # The same read over a block-outermost cache: one run per block run, whatever the layer count.
    outer = synthetic_layout(args.layers, 4 * nblocks + 200, args.block_size, 8, 128, blocks_outer=True)
    outer_runs, outer_ms, outer_bytes = timed(True, outer)
    expected = block_runs(remote, local)
    assert outer_bytes == nbytes and outer_runs == expected, (outer_runs, expected)
    row.update(block_outer_runs=outer_runs, block_runs=expected, block_outer_build_ms_p50=outer_ms)
    print(f"  block-outermost      : {outer_runs:6d} runs  build p50 {outer_ms:7.2f} ms  "
          f"(= {expected} block runs; layer-outermost needs {runs})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
