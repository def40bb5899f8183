"""One connector instance without an engine, configured only from the environment the way a
deployment configures it (PDXFER_MASTER, PDXFER_MASTER_TOKEN_FILE, PDXFER_LISTEN_HOST,
PDXFER_ADVERTISE_HOST, PDXFER_LISTEN_PORT): real scheduler and worker halves, vLLM's BlockPool,
seeded KV-shaped tensors and the TCP transport.

  python -m tests.transport.netns_node hold --tokens N --seed S
      computes (seeds) a prompt's KV, publishes it, prints ``HELD <json>`` with the digest of
      every block the prompt occupies, then serves until stdin closes.
  python -m tests.transport.netns_node read --tokens N --seed S
      looks the same prompt up, loads it, prints ``READ <json>`` with the tokens loaded, load
      errors and the digest of every block it loaded into, and exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time

import torch
from vllm.v1.core.block_pool import BlockPool

from pdxfer.kv.layout import describe_kv_caches
from pdxfer.contracts.connector_config import parse_extra_config
from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide
from pdxfer.vllm.worker.worker_side import WorkerSide

BS = 128
NUM_BLOCKS = 32
LAYERS = 3


def _kv(seed: int | None) -> dict[str, torch.Tensor]:
    buf = torch.zeros(LAYERS, NUM_BLOCKS, 2, BS, 2 * 16, dtype=torch.bfloat16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g).to(torch.bfloat16))
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


def _digests(kv: dict[str, torch.Tensor], ids: list[int]) -> list[str]:
    return [hashlib.sha256(b"".join(kv[n][b].contiguous().view(torch.uint8).numpy().tobytes()
                                    for n in sorted(kv))).hexdigest()[:16] for b in ids]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


class Node:
    def __init__(self, name: str, producer: bool, seed: int | None) -> None:
        self.kv = _kv(seed)
        layout = describe_kv_caches(self.kv, block_size=BS)
        # Only documented keys; every address comes from the environment.
        self.cfg = parse_extra_config({"transport": "tcp", "publish_wait_s": 2.0, "retention_s": 300.0})
        self.pool = BlockPool(NUM_BLOCKS, True, BS)
        self.sched = SchedulerSide(self.cfg, engine_id=name, model_id="tiny", layout_fingerprint=layout.fingerprint(),
                                   content_fingerprint=layout.content_fingerprint(layout.kv_heads),
                                   total_kv_heads=layout.kv_heads, block_size=BS, producer=producer,
                                   consumer=not producer)
        self.sched.bind_block_pool(self.pool)
        self.worker = WorkerSide(self.cfg, node_id=f"{name}-r0", rank=0, expected_fingerprint=layout.fingerprint(),
                                 block_size=BS)
        self.sched.on_handshake([self.worker.register_kv_caches(self.kv)])

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def hold(tokens: list[int], seed: int) -> None:
    node = Node("holder", True, seed)
    blocks = node.pool.get_new_blocks(-(-len(tokens) // BS))
    ids = [b.block_id for b in blocks]
    published = node.sched.request_finished("p1", tokens, ids, None)
    node.pool.free_blocks(blocks)
    print("HELD " + json.dumps({"published": published, "digests": _digests(node.kv, ids),
                                "port": node.worker.transport.port}), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    node.close()


def read(tokens: list[int], timeout: float) -> None:
    node = Node("reader", False, None)
    out: dict = {"ext": 0, "errors": [], "digests": []}
    deadline = time.monotonic() + timeout
    ext = 0
    while time.monotonic() < deadline:  # the holder's publish may still be on its way
        ext, _ = node.sched.get_num_new_matched_tokens("d1", tokens, len(tokens), 0, None)
        if ext:
            break
        time.sleep(0.1)
    if ext:
        blocks = node.pool.get_new_blocks(-(-len(tokens) // BS))
        ids = [b.block_id for b in blocks]
        node.sched.update_state_after_alloc("d1", ids, ext)
        node.worker.start_loads(node.sched.build_connector_meta())
        while "d1" not in node.worker.get_finished():
            if time.monotonic() > deadline:
                raise SystemExit("load never finished")
            time.sleep(0.005)
        out = {"ext": ext, "errors": sorted(node.worker.take_load_errors()), "digests": _digests(node.kv, ids)}
    print("READ " + json.dumps(out), flush=True)
    node.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("hold", "read"))
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    tokens = _prompt(a.tokens, a.seed)
    if a.role == "hold":
        hold(tokens, a.seed)
    else:
        read(tokens, a.timeout)


if __name__ == "__main__":
    main()
