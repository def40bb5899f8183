"""The holder side of a move: KV tensors of one format registered with one transport.

    python -m tests.gpu.holder --kind tcp --format flash_nhd --layers 4 --num-blocks 1024 \\
        --block-size 16 --heads 8 --head-dim 128 --device cuda:0 --seed 7

prints ``META <metadata hex> <layout JSON>`` and serves until its stdin closes (the reader
holds the other end, so a dead reader ends it too) or ``--max-s`` passes.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time

from pdxfer.transport import create_transport, transport_options
from tests.gpu.kv import KVSpec, describe, make_kv, registered_regions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests.gpu.holder")
    ap.add_argument("--kind", required=True)
    ap.add_argument("--format", required=True)
    for name in ("--layers", "--num-blocks", "--block-size", "--heads", "--head-dim", "--seed"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--max-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    spec = KVSpec(a.format, a.layers, a.num_blocks, a.block_size, a.heads, a.head_dim)
    kv = make_kv(spec, a.device, a.seed)
    layout = describe(spec, kv)
    t = create_transport(a.kind, **transport_options(a.kind, listen_host="127.0.0.1"))
    try:
        t.register(registered_regions(layout, kv))
        print("META", t.metadata().hex(), json.dumps(layout.to_wire(), separators=(",", ":")), flush=True)
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
