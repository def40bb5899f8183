"""Scheduler half of the pdxfer connector: what vLLM's engine-core process calls, routed to the
reader path (:mod:`pdxfer.vllm.scheduler.reader`: lookup, lock, load specs) and the holder path
(:mod:`pdxfer.vllm.scheduler.holder`: publish, hold, reap, re-publish).

Nothing here imports vLLM: requests and the block pool are used through the few attributes the
two paths name, so the logic is testable with vLLM's real ``BlockPool`` and a real master,
without an engine.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

from pdxfer.kv.groups import LAYOUT_KEY as GROUPS_LAYOUT_KEY
from pdxfer.kv.groups import KVGroups
from pdxfer.kv.keys import IncrementalHasher, Namespace
from pdxfer.kv.layout import KVLayout, LayoutError
from pdxfer.master import MasterClient, NodeInfo, RankEndpoint
from pdxfer.kv.chunks import chunk_span
from pdxfer.contracts.connector_config import ConnectorConfig
from pdxfer.vllm.scheduler.block_pool import BlockPoolHolder
from pdxfer.vllm.scheduler.holder import HolderPath
from pdxfer.vllm.metadata import PdxferConnectorMetadata, PdxferHandshake
from pdxfer.vllm.scheduler.reader import ReaderPath
from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats
from pdxfer.vllm.write_fence import WriteFence

log = logging.getLogger("pdxfer.vllm.scheduler")

__all__ = ["BlockPoolHolder", "SchedulerSide", "SchedulerStats"]


class SchedulerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        engine_id: str,
        model_id: str,
        layout_fingerprint: str,
        content_fingerprint: str,
        total_kv_heads: int,
        block_size: int,
        producer: bool,
        consumer: bool,
        tp_size: int = 1,
        client_factory: Callable[..., Any] | None = None,
        kv_groups: KVGroups | None = None,
    ):
        """``layout_fingerprint``: the byte format of one rank's KV (checked against every worker);
        ``content_fingerprint``: what the KV holds, independent of format, block size and TP (the
        namespace); ``total_kv_heads``: the model's KV heads over all ``tp_size`` ranks;
        ``kv_groups``: a hybrid model's KV cache groups (None: one full-attention group)."""
        if tp_size < 1 or total_kv_heads < 1:
            raise ValueError(f"tp_size and total_kv_heads must be >= 1, got {tp_size}, {total_kv_heads}")
        chunk_span(0, cfg.chunk_tokens, block_size)  # refuses incompatible chunk/block sizes early
        self.kv_groups = kv_groups or KVGroups.plain()
        if self.kv_groups.hybrid and cfg.chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {cfg.chunk_tokens} must be a multiple of the block size {block_size} "
                             f"for a hybrid model (KV cache groups {self.kv_groups.signature()})")
        self.cfg = cfg
        self.engine_id = engine_id
        self.model_id = model_id
        self.layout_fingerprint = layout_fingerprint
        self.content_fingerprint = content_fingerprint
        self.total_kv_heads = total_kv_heads
        self.tp_size = tp_size
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        # A holder publishes its finished requests and serves reads of them: every prefill, and a
        # decode too unless publish_as_decode is off (then it only reads, as before).
        self.publishes = producer or (consumer and cfg.publish_as_decode)
        self.node_id: str | None = None  # set when the worker's handshake arrives
        self.stats = SchedulerStats()
        factory = client_factory or MasterClient
        # Hot path client (lookup, publish) with the short bound; background client for the rest.
        self._hot = factory(cfg.master, token=cfg.token, timeout_s=cfg.lookup_timeout_s)
        self._bg = factory(cfg.master, token=cfg.token, timeout_s=cfg.master_timeout_s)
        self._hashers: dict[str, IncrementalHasher] = {}
        self._kept_out_reasons: set[str] = set()
        self.reader = ReaderPath(cfg, block_size=block_size, tp_size=tp_size, total_kv_heads=total_kv_heads,
                                 reader_id=f"{engine_id}-reader", hot=self._hot, bg=self._bg, stats=self.stats,
                                 hasher=self._hasher, own_node=lambda: self.node_id, kv_groups=self.kv_groups)
        # Only a holder publishes, so only a holder needs to know when the device wrote its KV.
        self.fence: WriteFence | None = WriteFence.create(engine_id, tp_size) if self.publishes else None
        self._step_seq = 0  # of the newest step built
        self._req_step: dict[str, int] = {}  # request -> the newest step that scheduled it
        self._opaque_step = 0  # the newest step built without the list of what it scheduled
        self.holder = HolderPath(cfg, block_size=block_size, hot=self._hot, bg=self._bg, stats=self.stats,
                                 fence=self.fence, tp_size=tp_size, kv_groups=self.kv_groups)

    # ------------------------------------------------------------------ setup

    def gauges(self) -> dict[str, float]:
        """What this instance holds for readers now (vllm:pdxfer_held_*; zeros if it never
        publishes) and, with load_benefit, what its load gate measured (per-token costs)."""
        gate = self.reader.gate.gauges() if self.reader.gate is not None else {}
        if not self.publishes:
            return {"held_blocks": 0, "held_chunks": 0, "held_blocks_cap": 0, "host_chunks": 0,
                    "host_slots_used": 0, **gate}
        return {"held_blocks": self.holder.held_blocks, "held_chunks": self.holder.held_chunks,
                "held_blocks_cap": self.holder.held_blocks_cap, "host_chunks": self.holder.host_chunks,
                "host_slots_used": self.holder.host_slots_used, **gate}

    def bind_block_pool(self, pool: Any) -> None:
        self.holder.bind_block_pool(pool)
        if self.kv_groups.hybrid:
            self.reader.null_block = BlockPoolHolder(pool).null_block_id

    def on_handshake(self, handshakes: Iterable[PdxferHandshake]) -> None:
        """Every TP rank registered its KV with the transport: check that the ranks form one
        engine this scheduler can describe, register it as ONE node with every rank's endpoint,
        start holding. Refuses (raises, naming both sides) only what cannot work at all."""
        by_rank: dict[int, PdxferHandshake] = {}
        for hs in handshakes:
            hs.check()
            if hs.rank in by_rank:
                raise LayoutError(f"two workers of engine {self.engine_id} report TP rank {hs.rank}")
            by_rank[hs.rank] = hs
        if sorted(by_rank) != list(range(self.tp_size)):
            raise LayoutError(f"engine {self.engine_id} has tensor_parallel_size {self.tp_size}, but its workers "
                              f"reported TP ranks {sorted(by_rank)}")
        layouts: dict[int, KVLayout] = {}
        for rank, hs in sorted(by_rank.items()):
            self._check_rank(hs)
            layouts[rank] = KVLayout.from_wire(hs.layout)
        rank0 = by_rank[0]
        self.node_id = rank0.node_id
        self.reader.set_local_layouts(layouts)
        # The one line that tells two instances that should share KV but never hit apart.
        log.info("pdxfer: engine %s (%s) keys prompts in namespace %s: model %r, KV content %s, chunks of %d "
                 "tokens (a request's cache salt makes a namespace of its own); instances that share KV "
                 "log the same namespace", self.engine_id, self.role, self.namespace(None).root().hex()[:16],
                 self.model_id, self.content_fingerprint, self.cfg.chunk_tokens)
        if self.publishes:
            # Host slots every rank has (older workers report none: no host tier); host slot s
            # is block id N + s at the master, N = the device KV cache's block count.
            host_slots = min(int(getattr(hs, "host_blocks", 0) or 0) for hs in by_rank.values())
            if host_slots > 0:
                self.holder.set_host_tier(host_slots, layouts[0].num_blocks)
            more = tuple(RankEndpoint(r, hs.transport_metadata, hs.layout, hs.layout_fingerprint)
                         for r, hs in sorted(by_rank.items()) if r != 0)
            # Namespace, chunk size, role and URL let a router that reads the master's index
            # hash prompts as this instance does and send a request to whoever holds it.
            self.holder.start(NodeInfo(node_id=rank0.node_id, rank=0, transport=rank0.transport,
                                       transport_metadata=rank0.transport_metadata, layout=rank0.layout,
                                       layout_fingerprint=rank0.layout_fingerprint, tp_size=self.tp_size,
                                       total_kv_heads=self.total_kv_heads, more_ranks=more,
                                       serve_url=self.cfg.serve_url or "",
                                       namespace=self.namespace(None).root().hex(),
                                       chunk_tokens=self.cfg.chunk_tokens, role=self.role))

    def _check_rank(self, hs: PdxferHandshake) -> None:
        """One worker agrees with what this scheduler derived from the config (else the keys it
        hashes would not name what that worker's bytes are)."""
        who = f"worker {hs.node_id} (TP rank {hs.rank})"
        if hs.layout_fingerprint != self.layout_fingerprint:
            raise LayoutError(f"{who} reports KV layout {hs.layout_fingerprint}, the scheduler derived "
                              f"{self.layout_fingerprint} from the config")
        if hs.tp_size not in (0, self.tp_size) or hs.total_kv_heads not in (0, self.total_kv_heads):
            raise LayoutError(f"{who} reports TP size {hs.tp_size} with {hs.total_kv_heads} KV heads in all, "
                              f"the scheduler has TP size {self.tp_size} with {self.total_kv_heads}")
        if hs.transport != self.cfg.transport:
            raise LayoutError(f"{who} registered with transport {hs.transport}, the scheduler is configured "
                              f"for {self.cfg.transport}")
        groups = KVGroups.from_wire(hs.layout.get(GROUPS_LAYOUT_KEY))
        if groups != self.kv_groups:
            raise LayoutError(f"{who} reports KV cache groups [{groups.signature()}], the scheduler derived "
                              f"[{self.kv_groups.signature()}] from the config")
        content = KVLayout.from_wire(hs.layout).content_fingerprint(
            self.total_kv_heads, groups.signature() if groups.hybrid else "")
        if content != self.content_fingerprint:
            raise LayoutError(f"{who} holds KV content {content}, the scheduler derived {self.content_fingerprint} "
                              "from the config; keys would not name what the bytes are")

    @property
    def role(self) -> str:
        """vLLM's name for what this instance does in a P/D pair."""
        if self.producer and self.consumer:
            return "kv_both"
        return "kv_producer" if self.producer else "kv_consumer"

    def namespace(self, cache_salt: str | None) -> Namespace:
        # Content, not layout, and no TP (see Namespace): any instance of this model and dtype
        # finds these keys and decides per holder whether it can read them.
        return Namespace(self.model_id, self.content_fingerprint, self.cfg.chunk_tokens, cache_salt)

    def _new_hasher(self, cache_salt: str | None) -> IncrementalHasher:
        return IncrementalHasher(self.cfg.chunk_tokens, self.namespace(cache_salt).root())

    def _hasher(self, req_id: str, cache_salt: str | None) -> IncrementalHasher:
        h = self._hashers.get(req_id)
        if h is None:
            h = self._hashers[req_id] = self._new_hasher(cache_salt)
        return h

    # ------------------------------------------------------------------ reader (consumer) path

    def get_num_new_matched_tokens(self, req_id: str, tokens: Sequence[int], num_tokens: int,
                                   num_computed_tokens: int, cache_salt: str | None,
                                   unkeyable: str | None = None,
                                   hinted_tokens: int = 0) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be read from holders; never raises.
        ``unkeyable``: why the tokens do not name this request's KV (then: no lookup);
        ``hinted_tokens``: leading tokens a prefill said it published (None back: ask again)."""
        self.holder.drain_frees()
        if not self.consumer:
            return 0, False
        if unkeyable is not None:
            self._keep_out(req_id, unkeyable)
            return 0, False
        return self.reader.get_num_new_matched_tokens(req_id, tokens, num_tokens, num_computed_tokens,
                                                       cache_salt, hinted_tokens)

    def update_state_after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 group_block_ids: Sequence[Sequence[int]] | None = None) -> None:
        """``group_block_ids``: a hybrid model's block table per KV cache group."""
        self.reader.update_state_after_alloc(req_id, block_ids, num_external_tokens, group_block_ids)

    def build_connector_meta(self, scheduled: Iterable[str] | None = None,
                             scheduled_tokens: dict[str, int] | None = None) -> PdxferConnectorMetadata:
        """The step's metadata; ``scheduled``: the ids of the requests it computes (None:
        unknown, then every request finishing later waits for this step's writes);
        ``scheduled_tokens``: how many tokens each computes (None: unknown)."""
        self.holder.drain_frees()
        meta = self.reader.take_metadata(scheduled_tokens)
        if self.publishes:
            # Jobs queued when their request finished: its KV writes were enqueued in an earlier
            # step, which the worker's copy is ordered after.
            meta.offloads = self.holder.take_offloads()
        if self.fence is not None:
            self._step_seq += 1
            meta.step_seq, meta.write_fence = self._step_seq, self.fence.name
            if scheduled is None:
                self._opaque_step = self._step_seq
            else:
                for req_id in scheduled:
                    self._req_step[req_id] = self._step_seq
        return meta

    def _write_seq(self, req_id: str) -> int:
        """The step whose completion on the device makes every KV write into ``req_id``'s blocks
        visible: the newest one that scheduled it (blocks it shares through the prefix cache were
        written in steps no later). A request never seen scheduled waits for the newest built."""
        step = self._req_step.pop(req_id, None)
        return max(self._step_seq if step is None else step, self._opaque_step)

    # ------------------------------------------------------------------ holder path

    def request_finished(self, req_id: str, tokens: Sequence[int] | None, block_ids: Sequence[int],
                         cache_salt: str | None, unkeyable: str | None = None,
                         group_block_ids: Sequence[Sequence[int]] | None = None,
                         state_final: bool = False) -> int:
        """Publish every full chunk (and the tail) of a finished request and hold its blocks, on
        a prefill and, with ``publish_as_decode``, on a decode. ``tokens``: the tokens whose KV is
        in ``block_ids`` (None: nothing publishable, e.g. aborted); a decode's blocks hold what it
        loaded and what it computed alike;
        ``unkeyable``: why the tokens do not name this request's KV (then: no publish);
        ``state_final``: recurrent groups' state is the state after exactly ``tokens``.
        Returns the leading tokens the queued publish covers (0: none)."""
        self.reader.finish_request(req_id)
        hasher = self._hashers.pop(req_id, None)
        write_seq = self._write_seq(req_id)
        if unkeyable is not None and self.publishes and tokens is not None:
            self._keep_out(req_id, unkeyable)
            tokens = None
        if not self.publishes:
            self.holder.drain_frees()
            return 0
        return self.holder.request_finished(req_id, tokens, block_ids, hasher,
                                            lambda: self._new_hasher(cache_salt), write_seq=write_seq,
                                            group_block_ids=group_block_ids, state_final=state_final)

    def _keep_out(self, req_id: str, reason: str) -> None:
        self.stats.unkeyable_requests += 1
        if reason not in self._kept_out_reasons:  # once per reason: a LoRA fleet would flood the log
            self._kept_out_reasons.add(reason)
            log.warning("pdxfer: request %s is kept out of KV transfer because %s (its token ids do not "
                        "name its KV); such requests are computed locally", req_id, reason)

    def step_output(self, finished_recving: Any) -> None:
        """A step's output reached the scheduler: what it says about this instance's loads."""
        self.holder.drain_frees()
        self.reader.step_output(finished_recving)

    def worker_output(self, worker_meta: Any) -> None:
        """The workers' aggregated metadata of a step (None: nothing): offload jobs done or failed."""
        if self.publishes:
            self.holder.offload_output(worker_meta)

    def has_pending_push_work(self) -> bool:
        """Offload jobs queued or not yet answered by every TP rank (each one bounded)."""
        return self.publishes and self.holder.has_pending_offloads()

    def drain_frees(self) -> None:
        self.holder.drain_frees()

    def has_pending_frees(self) -> bool:
        return self.holder.has_pending_frees()

    @property
    def held_chunks(self) -> int:
        return self.holder.held_chunks

    @property
    def held_blocks(self) -> int:
        return self.holder.held_blocks

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        self.holder.close()
        self.reader.close()
        if self.fence is not None:
            self.fence.close()
        for c in (self._hot, self._bg):
            try:
                c.close()
            except Exception:
                pass
