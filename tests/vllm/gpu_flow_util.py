"""One instance's worth of connector state as a CUDA instance of vLLM builds it, without a GPU.

vLLM's platform reports CUDA (the ``cuda`` fixture of tests/vllm/test_connector_layout_gpu.py),
the KV tensors are vLLM's own per-layer views (``create_kv_cache_views``) of CPU memory, and the
scheduler, worker and fence writer are built from the same derivations ``PdxferConnector``
makes (fingerprints, format, dtype, heads). GPU-only work -- the step's KV writes, the fence's
event, the staging scatter -- runs on the asynchronous CPU stand-in, which lands each operation
``delay_s`` after it was enqueued, so bytes used before their event completed are stale here as
they would be on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.v1.core.block_pool import BlockPool

from pdxfer.device import DeviceEvent, device_ops_for, flat_bytes
from pdxfer.contracts.connector_config import parse_extra_config
from pdxfer.vllm.connector_layout import (derive_content_fingerprint, derive_kv_dtype, derive_layout_fingerprint,
                                         kv_format, total_kv_heads)
from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide
from pdxfer.vllm.worker.worker_side import WorkerSide
from pdxfer.vllm.write_fence import FenceWriter
from tests.vllm.test_connector_layout_gpu import _configs, _vllm_tensors

NUM_BLOCKS = 24
CHUNK = 64  # tokens per published chunk: a few blocks of every block size used here
WRITE_PIECES = 4  # the "forward" lands its KV writes in this many queued copies (each delayed)


@dataclass
class Load:
    """What a reader saw of one load: tokens, its blocks, errors, and, at the moment the worker
    first reported the load finished, the loaded tokens' KV and whether every scatter it had
    enqueued had completed."""

    ext: int
    ids: list[int]
    errors: set[int]
    kv_at_report: torch.Tensor | None = None
    scatters: list[DeviceEvent] = field(default_factory=list)
    scatters_pending_at_enqueue: int = 0
    scatters_done_at_report: bool = True


def token_kv(kv: dict[str, torch.Tensor], ids: list[int], block_size: int, n: int) -> torch.Tensor:
    """[layers, n, H, C]: the KV of a sequence's first ``n`` tokens through vLLM's logical
    [B, H, N, C] views (whatever the physical KVCacheLayout under them)."""
    t = torch.arange(n)
    blocks = torch.tensor(ids)[t // block_size]
    return torch.stack([kv[name][blocks, :, t % block_size, :] for name in sorted(kv)])


class GpuNode:
    """A holder (producer) or a reader (consumer) of one backend, KVCacheLayout and block size."""

    def __init__(self, name: str, master_addr: str, *, producer: bool, layout: str, block_size: int,
                 mla: bool = False, transport: str = "tcp", **extra) -> None:
        vc, kcc = _configs(layout, mla=mla, block_size=block_size, head_size=576 if mla else 64)
        heads = kcc.kv_cache_groups[0].kv_cache_spec.num_kv_heads
        vc.model_config.get_total_num_kv_heads = lambda: heads  # TP 1: this rank has every head
        self.bs = block_size
        self.kv = _vllm_tensors(vc, kcc, NUM_BLOCKS)
        self.flat = flat_bytes(next(iter(self.kv.values())))
        fp = derive_layout_fingerprint(vc, kcc)
        # No wait on the step path: the publish lands when the fence lets it (tests poll).
        self.cfg = parse_extra_config({"master": master_addr, "transport": transport, "chunk_tokens": CHUNK,
                                       "publish_wait_s": 0.0, "staging_mib": 4, **extra})
        self.pool = BlockPool(NUM_BLOCKS, True, block_size)
        self.sched = SchedulerSide(self.cfg, engine_id=name, model_id="tiny-gpu", layout_fingerprint=fp,
                                   content_fingerprint=derive_content_fingerprint(vc, kcc),
                                   total_kv_heads=total_kv_heads(vc), block_size=block_size,
                                   producer=producer, consumer=not producer)
        self.sched.bind_block_pool(self.pool)
        self.worker = WorkerSide(self.cfg, node_id=f"{name}-r0", rank=0, expected_fingerprint=fp,
                                 block_size=block_size, kv_format=kv_format(vc, kcc),
                                 kv_dtype=derive_kv_dtype(vc, kcc), total_kv_heads=total_kv_heads(vc))
        self.sched.on_handshake([self.worker.register_kv_caches(self.kv)])
        # As PdxferConnector.register_kv_caches: the fence's device is the KV tensors' own.
        self.fence_writer = FenceWriter(0, device=str(next(iter(self.kv.values())).device))
        self.ops = device_ops_for(str(self.flat.device))
        self.written: torch.Tensor | None = None  # the storage bytes once the last compute() landed
        self.fence_after_enqueue = 0  # the fence right after the last compute()'s wait_for_save

    # ------------------------------------------------------------------ holder

    def compute(self, rid: str, tokens: list[int], seed: int) -> tuple[list[int], int]:
        """One engine step that computes ``tokens`` into fresh blocks, then the request finishes:
        the step's KV writes are enqueued on the compute stream (the stand-in lands them later),
        vLLM's ``wait_for_save`` records the fence, the scheduler sees the request finished.
        Returns (block ids, the step's number). ``self.written``: the storage bytes once the
        writes landed, set before anything is enqueued (a publish may be sent before this returns)."""
        blocks = self.pool.get_new_blocks(-(-len(tokens) // self.bs))
        ids = [b.block_id for b in blocks]
        meta = self.sched.build_connector_meta([rid])
        target = self.flat.clone()
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            view = torch.as_strided(target.view(t.dtype), t.shape, t.stride(), t.storage_offset())
            view[ids] = torch.randn(view[ids].shape, generator=g).to(t.dtype)
        self.written = target
        stream = self.ops.current_stream()
        piece = -(-target.numel() // WRITE_PIECES)
        for off in range(0, target.numel(), piece):
            self.ops.copy(self.flat, off, target, off, min(piece, target.numel() - off), stream)
        self.fence_writer.step_enqueued(meta.write_fence, meta.step_seq)
        # Read at once: the writes land WRITE_PIECES x delay_s later, so this margin is wide.
        self.fence_after_enqueue = self.sched.fence.completed()
        self.sched.request_finished(rid, tokens, ids, None)
        self.pool.free_blocks(blocks)
        return ids, meta.step_seq

    # ------------------------------------------------------------------ reader

    def load(self, rid: str, tokens: list[int], timeout: float = 10.0) -> Load:
        """Scheduler and worker path of one reader request, as vLLM drives the hooks: lookup,
        allocation, the step's metadata bound (reads posted), ``get_finished`` every step."""
        ext, is_async = self.sched.get_num_new_matched_tokens(rid, tokens, len(tokens), 0, None)
        if ext == 0:
            return Load(0, [], set())
        assert is_async
        ids = [b.block_id for b in self.pool.get_new_blocks(-(-len(tokens) // self.bs))]
        self.sched.update_state_after_alloc(rid, ids, ext)
        out = Load(ext, ids, set())
        staging = self.worker._staging
        real_start = staging.start_scatter

        def spy(s):  # every scatter the load enqueues, and whether it ran at once (it must not)
            ev = real_start(s)
            out.scatters.append(ev)
            out.scatters_pending_at_enqueue += not ev.query()
            return ev

        staging.start_scatter = spy
        try:
            self.worker.start_loads(self.sched.build_connector_meta([rid]))
            deadline = time.monotonic() + timeout
            while rid not in self.worker.get_finished():
                assert time.monotonic() < deadline, f"the load of {rid} never finished"
                time.sleep(0.002)
            # The instant it is reported: vLLM may run attention over these blocks now.
            out.scatters_done_at_report = all(ev.query() for ev in out.scatters)
            out.kv_at_report = token_kv(self.kv, ids, self.bs, ext).clone()
        finally:
            del staging.start_scatter
        out.errors = self.worker.take_load_errors()
        return out

    def close(self) -> None:
        self.fence_writer.close()
        self.sched.close()
        self.worker.close()
