"""The holder of the end-to-end rdma test: a KV cache in vLLM's CPU format, registered with NIXL,
published to a pdxfer-master, served until SIGTERM.

  python -m tests.rdma.e2e_peer --master HOST:PORT --node-id NAME
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch

from pdxfer.kv.keys import chunk_hashes
from pdxfer.kv.layout import KVLayout, describe_kv_caches
from pdxfer.master import MasterClient, NodeInfo, NodeSession
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion

LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 64, 2, 128, 64
CHUNK_TOKENS = 256
TOKENS = list(range(1000, 1000 + 3 * CHUNK_TOKENS))  # three full chunks


def kv_cache(seed: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One allocation, one view per layer (as vLLM hands them over); random bytes when seeded."""
    whole = torch.zeros(LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.float16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        whole.view(torch.int16).copy_(torch.randint(-32768, 32767, whole.shape, generator=g, dtype=torch.int16))
    return whole, {f"model.layers.{i}.attn": whole[i] for i in range(LAYERS)}


def holder_blocks(chunk: int) -> list[int]:
    return [10 + 2 * chunk, 11 + 2 * chunk]


def layout_of(caches: dict[str, torch.Tensor]) -> KVLayout:
    return describe_kv_caches(caches, block_size=BLOCK_SIZE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    # Blocked before any thread starts (NIXL's, the lease's), so SIGTERM reaches sigwait below.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _whole, caches = kv_cache(a.seed)  # the views keep the allocation alive
    layout = layout_of(caches)
    t = create_transport("nixl")
    t.register([RegisteredRegion(r.index, r.ptr, r.nbytes) for r in layout.regions])
    client = MasterClient(a.master, timeout_s=10.0)
    info = NodeInfo(a.node_id, 0, "nixl", t.metadata(), layout.to_wire(), layout.fingerprint())
    session = NodeSession(client, info, lease_ttl_s=30.0)
    session.start()
    keys = chunk_hashes(TOKENS, CHUNK_TOKENS)
    accepted = client.publish(a.node_id, [(k, holder_blocks(i)) for i, k in enumerate(keys)], retention_s=600)
    print("READY", accepted, flush=True)
    signal.sigwait({signal.SIGTERM})
    session.stop()
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
