"""A holder process with real KV tensors in one vLLM format, for the layout-conversion tests.

  python -m tests.transport.kv_peer --kind tcp --format flash_hnd --block 16 --num-blocks 12 \\
      --layers 2 --total-heads 4 --tp 2 --rank 1 --head-dim 8 --ntokens 100 --blocks 3,0,2,... [--opt k=v]

builds the TP rank's KV (its heads per vLLM's split, ``pdxfer.kv.heads.rank_heads``) for a
``ntokens``-token sequence stored in ``--blocks`` with ``tests.kv_pattern``'s value per (layer,
K/V, token, model head, dim), -1 everywhere else; registers the tensor's regions with the
transport, prints ``META <hex> <layout JSON>`` and serves until SIGTERM. Dies with its parent.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from pdxfer.kv.heads import rank_heads
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion
from tests.kv_pattern import describe, encode, pattern_logical
from tests.transport.peer_proc import _die_with_parent, _opts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv_peer")
    for name in ("--kind", "--format", "--blocks"):
        ap.add_argument(name, required=True)
    for name in ("--block", "--num-blocks", "--layers", "--total-heads", "--tp", "--rank", "--head-dim",
                 "--ntokens"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--opt", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0, help="pattern seed (tests.kv_pattern.pattern_value)")
    a = ap.parse_args(argv)
    _die_with_parent()
    heads = rank_heads(a.total_heads, a.tp, a.rank)
    blocks = [int(b) for b in a.blocks.split(",")]
    logical = pattern_logical(a.layers, blocks, a.num_blocks, a.block, heads.first, heads.count, a.total_heads,
                              a.head_dim, a.ntokens, seed=a.seed)
    phys = encode(a.format, logical)
    layout = describe(a.format, phys, a.block)
    t = create_transport(a.kind, **_opts(a.opt))
    t.register([RegisteredRegion(r.index, r.ptr, r.nbytes) for r in layout.regions])
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("META", t.metadata().hex(), json.dumps(layout.to_wire(), separators=(",", ":")), flush=True)
    while not stop:
        time.sleep(0.2)  # the transport's threads serve; `phys` stays alive until here
    t.close()
    del phys
    return 0


if __name__ == "__main__":
    sys.exit(main())
