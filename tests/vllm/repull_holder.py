"""A holder process for the re-pull tests: a real KV cache (``tests.chaos.kv`` pattern) over the
real TCP transport, registered at a real master, publishing whole prompts of ``tests.chaos.kv``.

  python -m tests.vllm.repull_holder --master HOST:PORT --node-id h0 --block 32 --chunks 8 \\
      --chunk-tokens 64 --prompts 0,1 [--seed 5]

lays each prompt out in its own blocks (a chunk already held keeps its blocks), publishes every full
chunk, prints ``READY`` and serves (heartbeating its lease) until SIGTERM. Dies with its parent.

``--host-chunks 2,3`` gives it a host tier (pdxfer's HostPool, announced in its layout as a worker
does): those chunks of every prompt are copied into host slots and published there (block ids from
the KV cache's block count on), and KV blocks only such chunks use are overwritten with filler, so
a reader that read them from the KV cache instead would see it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from pdxfer.device import device_ops_for
from pdxfer.kv.layout import CPU, Region
from pdxfer.master import MasterClient, NodeInfo
from pdxfer.kv.tiers import HOST_LAYOUT_KEY
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion
from pdxfer.vllm.worker.host_pool import HostPool
from pdxfer.vllm.metadata import OffloadJob
from pdxfer.vllm.worker.staging import region_tensors
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
    ap.add_argument("--host-chunks", default="", help="comma-separated chunk indices served from host slots")
    a = ap.parse_args(argv)
    _die_with_parent()
    side = kv.Side(CPU, a.block)
    C, hb = a.chunk_tokens, a.block
    prompts = [int(p) for p in a.prompts.split(",")]
    per_prompt = -(-a.chunks * C // hb)
    phys, caches, layout = kv.new_cache(side, per_prompt * len(prompts) + 1)
    host_chunks = {int(c) for c in a.host_chunks.split(",") if c}
    regions = [RegisteredRegion(r.index, r.ptr, r.nbytes, r.device) for r in layout.regions]
    wire = layout.to_wire()
    pool = None
    if host_chunks:
        pool = HostPool(layout, region_tensors(caches, layout), per_prompt * len(prompts),
                        [Region(r.index, r.nbytes, r.device) for r in layout.regions], device_ops_for("cpu"))
        regions.append(pool.region())
        wire[HOST_LAYOUT_KEY] = pool.layout.to_wire()
    t = create_transport("tcp", listen_host="127.0.0.1")
    t.register(regions)
    client = MasterClient(a.master, timeout_s=5.0)
    info = NodeInfo(a.node_id, 0, "tcp", t.metadata(), wire, layout.fingerprint(), total_kv_heads=kv.HEADS)
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
            entries.append((c, bytes.fromhex(key), list(held[key])))
    if pool is not None:
        entries = _to_host(pool, phys, side, entries, host_chunks, layout.num_blocks)
    entries = [(key, ids) for _, key, ids in entries]
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


def _to_host(pool: HostPool, phys, side: kv.Side, entries: list, host_chunks: set[int], n_device: int) -> list:
    """Copy the blocks of the ``host_chunks`` entries into host slots (as an offload job would),
    overwrite KV blocks that no other entry uses with filler, and name the slots in those entries."""
    slot: dict[int, int] = {}
    for c, _, ids in entries:
        for b in ids if c in host_chunks else ():
            slot.setdefault(b, len(slot))
    pool.start(OffloadJob(1, tuple(slot), tuple(slot.values())))
    deadline = time.monotonic() + 10
    while pool.pending():
        done, failed = pool.poll()
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"host copy failed: {failed or 'timed out'}")
        time.sleep(0.005)
    device_used = {b for c, _, ids in entries if c not in host_chunks for b in ids}
    kv.fill_blocks(phys, side, sorted(set(slot) - device_used))
    return [(c, key, [n_device + slot[b] for b in ids] if c in host_chunks else ids) for c, key, ids in entries]


if __name__ == "__main__":
    sys.exit(main())
