"""One vLLM CPU instance without a model: vLLM's real ``Scheduler`` (which builds
``PdxferConnector`` as its connector, runs its hooks and decides when a request finished),
pdxfer's worker half on real KV tensors, and a stand-in forward pass.

The stand-in writes each scheduled token's KV as a function of the tokens up to and including
it (:func:`token_kv`), exactly the positions vLLM scheduled in that step, and samples the next
token from the tokens so far. KV no step wrote stays NaN, so a slot published or loaded without
ever being written shows up as NaN, and any instance that computed or loaded a prefix holds the
same numbers for it as :func:`token_kv` says.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pdxfer.vllm.connector_layout import derive_kv_dtype, kv_format
from pdxfer.vllm.worker.worker_side import WorkerSide
from pdxfer.vllm.write_fence import FenceWriter

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # the tiny model's attention layers
BS = 32
NUM_BLOCKS = 48
CHUNK = 64
MAX_LEN = 1024


def token_kv(tokens: list[int], kv_heads: int, width: int) -> torch.Tensor:
    """[layers, kv_heads, width]: the stand-in KV of the last of ``tokens`` (depends on them all)."""
    seed = int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LAYERS), kv_heads, width, generator=g)


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-4:]) * 31 + len(tokens)) % 4000 + 5


class Engine:
    """``role``: vLLM's kv_role; ``extra``: more kv_connector_extra_config."""

    def __init__(self, name: str, model_dir: str, master: str, role: str, **extra: Any) -> None:
        mc = ModelConfig(model=model_dir, dtype="float32", max_model_len=MAX_LEN)
        ktc = KVTransferConfig(kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.vllm",
                               kv_role=role, engine_id=name,
                               kv_connector_extra_config={"master": master, "chunk_tokens": CHUNK,
                                                          "publish_wait_s": 2.0, "max_held_fraction": 0.9,
                                                          **extra})
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS),
                        scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_LEN, max_num_seqs=8,
                                                         max_model_len=MAX_LEN, is_encoder_decoder=False),
                        kv_transfer_config=ktc)
        vc.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.kv_heads, self.head = mc.get_total_num_kv_heads(), mc.get_head_size()
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=self.kv_heads, head_size=self.head,
                                 dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        self.sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS)
        self.conn = self.sched.connector
        assert self.conn is not None and self.conn.refusal is None, getattr(self.conn, "refusal", None)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BS, hash_fn)
        # vLLM's CPU attention cache: per layer [blocks, KV heads, block size, K and V head dims].
        buf = torch.full((len(LAYERS), NUM_BLOCKS, self.kv_heads, BS, 2 * self.head), float("nan"))
        self.kv = {n: buf[i] for i, n in enumerate(LAYERS)}
        self.worker = WorkerSide(self.conn.cfg, node_id=name, rank=0, expected_fingerprint=self.conn.fingerprint,
                                 block_size=BS, kv_format=kv_format(vc, kcc), kv_dtype=derive_kv_dtype(vc, kcc),
                                 total_kv_heads=self.kv_heads, max_model_len=MAX_LEN)
        self.conn.set_xfer_handshake_metadata({0: self.worker.register_kv_caches(self.kv)})
        self.fence = FenceWriter(0, device="cpu")
        self.skip_fence = False  # True: the device never confirms a step's writes (a stuck stream)
        self._requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}  # finished requests, as vLLM left them
        self.answer_params: dict[str, Any] = {}  # the kv_transfer_params each answer carried
        self.blocks: dict[str, list[int]] = {}  # request -> its blocks, kept after it finished

    @property
    def side(self) -> Any:
        return self.conn.scheduler_side

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=self._block_hasher)
        self.sched.add_request(req)
        self._requests[rid] = req
        return req

    def step(self) -> None:
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        self.worker.start_loads(meta)  # as PdxferConnector.bind_connector_metadata
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            ids = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            self.blocks[rid] = list(ids)
            toks = req.all_token_ids
            end = req.num_computed_tokens  # schedule() already counted this step's tokens
            for p in range(end - n, end):
                kv = token_kv(toks[:p + 1], self.kv_heads, 2 * self.head)
                for li, name in enumerate(LAYERS):
                    self.kv[name][ids[p // BS], :, p % BS, :] = kv[li]
            req_ids.append(rid)
            sampled.append([next_token(toks)] if end >= req.num_tokens else [])
        if not self.skip_fence:
            self.fence.step_enqueued(meta.write_fence, meta.step_seq)  # as wait_for_save
        done = self.worker.get_finished()
        kvo = KVConnectorOutput(finished_recving=done or None, invalid_block_ids=self.worker.take_load_errors())
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, kv_connector_output=kvo)
        before = set(self.sched.requests)
        for outs in self.sched.update_from_output(out, mro).values():
            for o in outs.outputs:
                if o.finished:
                    self.answer_params[o.request_id] = o.kv_transfer_params
        for rid in before - set(self.sched.requests):
            self.finished[rid] = self._requests[rid]

    def run(self, rid: str, prompt: list[int], max_tokens: int, timeout: float = 20.0) -> Request:
        """Add a request and step until it finished (loads included); returns it."""
        req = self.add(rid, prompt, max_tokens)
        deadline = time.monotonic() + timeout
        while rid not in self.finished:
            assert time.monotonic() < deadline, f"{rid} never finished on {self.conn.engine_id}"
            self.step()
            if self.sched.requests.get(rid) is not None and not self.sched.requests[rid].num_computed_tokens:
                time.sleep(0.002)  # a load in flight: give the reads time, as steps would
        return req

    def close(self) -> None:
        self.fence.close()
        self.conn.shutdown()
        self.worker.close()
