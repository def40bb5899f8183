"""A worker process for tests/vllm/test_write_fence.py, kept apart so that a spawned child
imports only the device stand-in and the fence (not vLLM)."""

from __future__ import annotations

import time
from typing import Any

import torch

from pdxfer.device import CpuStandIn
from pdxfer.vllm.write_fence import FenceWriter


def one_slow_step(name: str, delay_s: float, conn: Any) -> None:
    """Rank 0 runs step 1, whose KV write lands ``delay_s`` after it is enqueued; it reports
    when the step's event was recorded and stays attached until told to go."""
    ops = CpuStandIn(asynchronous=True, delay_s=delay_s)
    writer = FenceWriter(0, ops)
    kv = torch.zeros(64, dtype=torch.uint8)
    ops.copy(kv, 0, torch.full((64,), 7, dtype=torch.uint8), 0, 64, ops.current_stream())
    writer.step_enqueued(name, 1)
    conn.send(time.monotonic())
    conn.recv()
    writer.close()
    ops.close()
