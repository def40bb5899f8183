"""The holder side of the moves: KV tensors of several layouts registered with one transport.

    python -m tests.gpu.holder --kind tcp --layouts flash_nhd:1024,kv_hnc/BLHNC:1024 --layers 4 \\
        --block-size 16 --heads 8 --head-dim 128 --device cuda:0 --seed 7

(``LAYOUT:NUM_BLOCKS`` each, LAYOUT a tests/gpu/kv.py VRAM_LAYOUTS name) registers every layout's
regions one after another and prints
``META <metadata hex> <JSON list of [layout name, first region index, layout]>``, then serves until its
stdin closes (the reader holds the other end, so a dead reader ends it too) or ``--max-s`` passes.
One holder per transport, not per layout: each start costs a CUDA context and an agent.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time

from pdxfer.transport import create_transport, transport_options
from tests.gpu.kv import KVSpec, describe, format_seed, make_kv, registered_regions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests.gpu.holder")
    ap.add_argument("--kind", required=True)
    ap.add_argument("--layouts", required=True)
    for name in ("--layers", "--block-size", "--heads", "--head-dim", "--seed"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--max-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    specs = []
    for item in a.layouts.split(","):
        name, _, nb = item.partition(":")
        specs.append(KVSpec(name, a.layers, int(nb), a.block_size, a.heads, a.head_dim))
    kvs, regions, table = [], [], []
    for i, spec in enumerate(specs):
        kv = make_kv(spec, a.device, format_seed(a.seed, i))
        layout = describe(spec, kv)
        table.append([spec.layout, len(regions), layout.to_wire()])
        regions += registered_regions(layout, kv, first_index=len(regions))
        kvs.append(kv)  # kept alive while served
    t = create_transport(a.kind, **transport_options(a.kind, listen_host="127.0.0.1"))
    try:
        t.register(regions)
        print("META", t.metadata().hex(), json.dumps(table, separators=(",", ":")), flush=True)
        deadline = time.monotonic() + a.max_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
            if ready and not sys.stdin.buffer.read1(4096):
                break  # EOF: the reader is done (or gone)
    finally:
        t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
