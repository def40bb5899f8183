"""A holder process for the re-pull tests: a real KV cache (``tests.chaos.kv`` pattern) over the
real TCP transport, registered at a real master, publishing whole prompts of ``tests.chaos.kv``.

  python -m tests.vllm.repull_holder --master HOST:PORT --node-id h0 --block 32 --chunks 8 \\
      --chunk-tokens 64 --prompts 0,1 [--seed 5]

lays each prompt out in its own blocks (a chunk already held keeps its blocks), publishes every full
chunk, prints ``READY`` and serves (heartbeating its lease) until SIGTERM. Dies with its parent.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from pdxfer.layout import CPU
from pdxfer.master import MasterClient, NodeInfo
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion
from tests.chaos import kv
from tests.transport.peer_proc import _die_with_parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="repull_holder")
    ap.add_argument("--master", required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--chunk-tokens", type=int, required=True)
    ap.add_argument("--prompts", required=True, help="comma-separated prompt numbers of tests.chaos.kv")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--lease-s", type=float, default=30.0)
    a = ap.parse_args(argv)
    _die_with_parent()
    side = kv.Side(CPU, a.block)
    C, hb = a.chunk_tokens, a.block
    prompts = [int(p) for p in a.prompts.split(",")]
    per_prompt = -(-a.chunks * C // hb)
    phys, _caches, layout = kv.new_cache(side, per_prompt * len(prompts) + 1)
    t = create_transport("tcp", listen_host="127.0.0.1")
    t.register([RegisteredRegion(r.index, r.ptr, r.nbytes, r.device) for r in layout.regions])
    client = MasterClient(a.master, timeout_s=5.0)
    info = NodeInfo(a.node_id, 0, "tcp", t.metadata(), layout.to_wire(), layout.fingerprint(), total_kv_heads=kv.HEADS)
    reg = client.register_node(info, lease_ttl_s=a.lease_s)
    held: dict[str, tuple[int, ...]] = {}
    entries = []
    nxt = 0
    for p in prompts:
        tokens = kv.prompt_tokens(a.seed, p, a.chunks, C)
        keys = kv.chunk_keys(a.seed, p, a.chunks, C)
        fresh: dict[int, int] = {}
        for c, key in enumerate(keys):
            if key in held:
                continue
            for j in range(c * C // hb, -(-(c + 1) * C // hb)):
                if j not in fresh:
                    fresh[j] = nxt
                    kv.write_block(phys, side, nxt, tokens, j * hb, min((j + 1) * hb, a.chunks * C))
                    nxt += 1
            held[key] = tuple(fresh[j] for j in range(c * C // hb, -(-(c + 1) * C // hb)))
            entries.append((bytes.fromhex(key), list(held[key])))
    client.publish(a.node_id, entries, retention_s=600.0, epoch=reg.epoch)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("READY", reg.epoch, flush=True)
    while not stop:
        time.sleep(0.2)
        client.heartbeat(a.node_id, reg.epoch)
    t.close()
    del phys
    return 0


if __name__ == "__main__":
    sys.exit(main())
