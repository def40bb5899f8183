"""``PdxferConnector``: the vLLM 0.32 ``KVConnectorBase_V1`` front of pdxfer.

A thin adapter: vLLM objects are turned into plain values here and handed to
:mod:`pdxfer.vllm.scheduler.scheduler_side` (engine-core process) or :mod:`pdxfer.vllm.worker.worker_side`
(worker process). Load with::

    --kv-transfer-config '{"kv_connector":"PdxferConnector","kv_connector_module_path":"pdxfer.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"master":"127.0.0.1:7000"}}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch  # noqa: F401  (vLLM imports it anyway; keeps import order predictable)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from pdxfer.contracts.connector_config import parse_extra_config
from pdxfer.kv.groups import KVGroups
from pdxfer.vllm.connector_layout import (derive_content_fingerprint, derive_layout_fingerprint, kv_block_size,
                                         derive_kv_dtype, kv_format, kv_refusal, model_identity, total_kv_heads)
from pdxfer.vllm.connector_stats import PdxferKVConnectorStats, PdxferPromMetrics
from pdxfer.vllm.keyability import publishable_tokens, unkeyable_reason
from pdxfer.vllm.kv_cache_spec import kv_groups, state_layers
from pdxfer.vllm.state_handoff import truncate_prefill_step
from pdxfer.vllm.state_views import check_state_inside, split_state_views
from pdxfer.vllm.metadata import PdxferConnectorMetadata, PdxferHandshake, PdxferWorkerMeta
from pdxfer.contracts.publish_hint import hinted_tokens, publish_hint
from pdxfer.vllm.write_fence import FenceWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("pdxfer.vllm")

def _setup_logging(level: str | None) -> None:
    """vLLM configures only its own logger: give pdxfer's a handler in vLLM's style once."""
    root = logging.getLogger("pdxfer")
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(h)
        root.propagate = False
    root.setLevel((level or "INFO").upper())


# SupportsHMA: vLLM keeps its hybrid KV cache manager on (several KV cache groups for a model
# mixing layer kinds); pdxfer moves full and sliding-window attention groups and the running
# state of Mamba / gated delta-net groups, and serves other hybrids without KV transfer
# (kv_refusal says why).
class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = parse_extra_config(ktc.kv_connector_extra_config)
        _setup_logging(self.cfg.log_level)
        from pdxfer.contracts.spin import apply_from_env

        apply_from_env()  # opt-in (PDXFER_VLLM_SPIN_SLEEP_US): see pdxfer/contracts/spin.py
        self.engine_id = str(ktc.engine_id)
        self.scheduler_side = None
        self.worker_side = None
        self._fence_writer: FenceWriter | None = None
        # Not None: no key can name this instance's KV (unprobed blocks, run-time KV scales, KV
        # cache groups it does not move). It then serves as a plain instance: every hook below
        # answers "nothing to move".
        self.refusal = kv_refusal(vllm_config, kv_cache_config)
        self._refusal_reported = False
        if self.refusal is not None:
            if role == KVConnectorRole.SCHEDULER:  # one error per instance, not one per process
                log.error("pdxfer: KV transfer is off for engine %s: %s. It serves as usual, every token "
                          "computed here; it neither publishes nor reads KV", self.engine_id, self.refusal)
            return
        self.block_size = kv_block_size(vllm_config, kv_cache_config)
        self.kv_groups = kv_groups(kv_cache_config) if kv_cache_config is not None else KVGroups.plain()
        self._state_layers = state_layers(kv_cache_config) if kv_cache_config is not None else set()
        self._dropped_token: dict[str, int] = {}  # prefill steps stopped one token short
        if self.kv_groups.hybrid and role == KVConnectorRole.SCHEDULER:
            log.info("pdxfer: engine %s moves KV cache groups [%s] (hybrid KV cache manager on)", self.engine_id,
                     self.kv_groups.signature())
        self.fingerprint = derive_layout_fingerprint(vllm_config, kv_cache_config)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        total_heads = total_kv_heads(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide

            # pdxfer's contract is "any failed load is a cache miss": vLLM's default policy
            # ("fail") would turn a dead holder or an expired lock into a failed request. The
            # scheduler reads the policy right after constructing its connector.
            if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                log.info("pdxfer: setting kv_load_failure_policy=recompute (failed loads are recomputed)")
                ktc.kv_load_failure_policy = "recompute"

            self.scheduler_side = SchedulerSide(
                self.cfg, engine_id=self.engine_id,
                model_id=self.cfg.model_id or model_identity(vllm_config),
                layout_fingerprint=self.fingerprint,
                content_fingerprint=derive_content_fingerprint(vllm_config, kv_cache_config),
                total_kv_heads=total_heads, block_size=self.block_size,
                producer=bool(ktc.is_kv_producer), consumer=bool(ktc.is_kv_consumer), tp_size=tp_size,
                kv_groups=self.kv_groups)
            self._sched_stats_sent = self.scheduler_side.stats.counters()
            self._gauges_sent: dict[str, float] = {}
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from pdxfer.vllm.worker.worker_side import WorkerSide

            rank = get_tensor_model_parallel_rank()
            self._rank = rank
            # One node per engine: every rank names it alike, the rank tells its endpoint apart.
            self.worker_side = WorkerSide(self.cfg, node_id=self.engine_id, rank=rank,
                                          expected_fingerprint=self.fingerprint, block_size=self.block_size,
                                          kv_format=kv_format(vllm_config, kv_cache_config),
                                          kv_dtype=derive_kv_dtype(vllm_config, kv_cache_config),
                                          tp_size=tp_size, total_kv_heads=total_heads,
                                          max_model_len=int(getattr(vllm_config.model_config, "max_model_len", 0) or 0),
                                          kv_groups=self.kv_groups)
            self._handshake: PdxferHandshake | None = None

    # pdxfer holds published blocks through block-pool references, not through vLLM's
    # delayed free, so a preempted producer request has no hand-off to protect.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ============================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self.refusal is not None:
            return  # nothing is registered, so nothing can be read from this instance
        assert self.worker_side is not None
        attention, state = split_state_views(kv_caches, self._state_layers)
        self._handshake = self.worker_side.register_kv_caches(attention)
        if state:
            assert self.worker_side.layout is not None
            check_state_inside(self.worker_side.layout, state)
        device = str(next(iter(kv_caches.values())).device) if kv_caches else "cpu"
        self._fence_writer = FenceWriter(self._rank, device=device)

    def get_handshake_metadata(self) -> PdxferHandshake | None:
        return getattr(self, "_handshake", None)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Post reads as soon as the step's metadata arrives: vLLM calls start_load_kv for async
        # loads only after the step's forward, which would delay every load by one forward.
        # Posting is non-blocking, so nothing on the forward path waits for it.
        if self.worker_side is not None and isinstance(connector_metadata, PdxferConnectorMetadata):
            self.worker_side.start_loads(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # reads were posted in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous, whole-request: nothing to wait for per layer

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # holders serve reads from vLLM's own blocks: nothing is copied out

    def wait_for_save(self) -> None:
        # vLLM calls this on the forward and the no-forward path alike, after the step's forward
        # (and, with speculative decoding, the drafter's) is enqueued: an event recorded here
        # follows every KV write of the step on the compute stream.
        meta = self._connector_metadata
        if self._fence_writer is not None and isinstance(meta, PdxferConnectorMetadata):
            self._fence_writer.step_enqueued(meta.write_fence, meta.step_seq)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        done = self.worker_side.get_finished()
        return None, (done or None)

    def build_connector_worker_meta(self) -> PdxferWorkerMeta | None:
        # Host-tier copies that ended on this rank since the last step (vLLM sums the ranks').
        return self.worker_side.take_worker_meta() if self.worker_side is not None else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self.worker_side is not None and self.kv_groups.hybrid:
            # Block ids are unique only within a KV cache group: a hybrid model's failed loads are
            # named by request (vLLM then recomputes the whole request).
            results.failed_recving = self.worker_side.take_failed_loads()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker_side is None:
            return set()
        errors = self.worker_side.take_load_errors()
        # A hybrid model's failures go as failed requests (get_transfer_results).
        return set() if self.kv_groups.hybrid else errors

    def get_kv_connector_stats(self) -> PdxferKVConnectorStats | None:
        if self.worker_side is not None:
            data = self.worker_side.take_stats()
        elif self.refusal is not None:
            # Once, from the scheduler (workers have no worker_side then): /metrics says why
            # this instance never loads, beside the error in its log.
            data = None
            if self._role == KVConnectorRole.SCHEDULER and not self._refusal_reported:
                self._refusal_reported = True
                data = {"kv_transfer_refused": 1}
        elif self.scheduler_side is not None:
            stats = self.scheduler_side.stats
            now = stats.counters()
            data = {k: now[k] - self._sched_stats_sent.get(k, 0) for k in now}
            data.update(stats.take_samples())
            self._sched_stats_sent = now
            # Gauges only when they changed: vLLM keeps the last value it was sent.
            gauges = self.scheduler_side.gauges()
            data.update({k: v for k, v in gauges.items() if self._gauges_sent.get(k) != v})
            changed_gauges = any(k in gauges for k in data)
            self._gauges_sent = gauges
            if not changed_gauges and not any(data.values()):
                data = None
        else:
            data = None
        return PdxferKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdxferKVConnectorStats:
        return PdxferKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PdxferPromMetrics:
        return PdxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._fence_writer is not None:
            self._fence_writer.close()
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            log.info("pdxfer: engine %s stopping: deregistering from the master (its chunks are no longer served)",
                     self.engine_id)
            self.scheduler_side.close()

    # ============================================================ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.bind_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_handshake(
                [m for _, m in sorted(metadata.items()) if isinstance(m, PdxferHandshake)])

    def on_new_request(self, request: "Request") -> None:
        if self.refusal is not None or not self.kv_groups.has_state:
            return
        dropped = truncate_prefill_step(request)
        if dropped is not None:
            # The hint names the prompt the decode holds: the whole one.
            self._dropped_token[request.request_id] = dropped

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.refusal is not None:
            return 0, False
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(
            request.request_id, request.all_token_ids, request.num_tokens, num_computed_tokens,
            request.cache_salt, unkeyable=unkeyable_reason(request),
            hinted_tokens=hinted_tokens(getattr(request, "kv_transfer_params", None),
                                        getattr(request, "prompt_token_ids", None)))

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # A load fills every group: the request's own blocks, a sliding group's window included.
        return tuple(range(len(self.kv_groups))) if self.refusal is None else ()

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self.refusal is not None:
            return
        assert self.scheduler_side is not None
        tables = blocks.get_block_ids() if num_external_tokens > 0 else ()
        block_ids = tables[0] if tables else []
        self.scheduler_side.update_state_after_alloc(
            request.request_id, block_ids, num_external_tokens,
            group_block_ids=tables if self.kv_groups.hybrid and tables else None)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.refusal is not None:
            return PdxferConnectorMetadata()
        assert self.scheduler_side is not None
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        if scheduled is None:
            return self.scheduler_side.build_connector_meta(None)
        return self.scheduler_side.build_connector_meta(scheduled.keys(), scheduled)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.step_output(getattr(connector_output, "finished_recving", None))
            self.scheduler_side.worker_output(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self.refusal is not None:
            return False, None
        assert self.scheduler_side is not None
        tokens = publishable_tokens(request)
        # No step writes a finished request's state again; it is the state after ``tokens`` only
        # when the request computed exactly them (not with a step still counted in flight).
        state_final = tokens is not None and len(tokens) == int(request.num_computed_tokens)
        published = self.scheduler_side.request_finished(
            request.request_id, tokens, block_ids[0] if block_ids else [], request.cache_salt,
            unkeyable=unkeyable_reason(request), group_block_ids=block_ids if self.kv_groups.hybrid else None,
            state_final=state_final)
        dropped = self._dropped_token.pop(request.request_id, None)
        if not self.scheduler_side.producer:
            # A decode's answer goes to the client, not to another instance: nobody waits for
            # its publish, so its response carries no hint (as before it published).
            return False, None
        prompt = getattr(request, "prompt_token_ids", None)
        if dropped is not None and prompt is not None:
            prompt = [*prompt, dropped]
        # The decode this response is handed to (by a proxy) waits for these chunks, bounded.
        return False, publish_hint(published, request.num_prompt_tokens, self.scheduler_side.cfg.chunk_tokens,
                                   prompt)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_frees()

    def has_pending_push_work(self) -> bool:
        # Host-tier copies in flight: vLLM keeps stepping until every rank answered (bounded).
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()
