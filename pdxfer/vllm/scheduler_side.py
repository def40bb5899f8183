"""Scheduler half of the pdxfer connector: what vLLM's engine-core process calls, routed to the
reader path (:mod:`pdxfer.vllm.reader`: lookup, lock, load specs) and the holder path
(:mod:`pdxfer.vllm.holder`: publish, hold, reap, re-publish).

Nothing here imports vLLM: requests and the block pool are used through the few attributes the
two paths name, so the logic is testable with vLLM's real ``BlockPool`` and a real master,
without an engine.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

from pdxfer.keys import IncrementalHasher, Namespace
from pdxfer.layout import LayoutError
from pdxfer.master import MasterClient, NodeInfo
from pdxfer.plan import chunk_span
from pdxfer.vllm.config import ConnectorConfig
from pdxfer.vllm.block_pool import BlockPoolHolder
from pdxfer.vllm.holder import HolderPath
from pdxfer.vllm.metadata import PdxferConnectorMetadata, PdxferHandshake
from pdxfer.vllm.reader import ReaderPath
from pdxfer.vllm.scheduler_state import SchedulerStats

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
        block_size: int,
        producer: bool,
        consumer: bool,
        tp_size: int = 1,
        client_factory: Callable[..., Any] | None = None,
    ):
        if tp_size != 1:
            raise ValueError(f"pdxfer connector supports tensor_parallel_size 1 in this version, got {tp_size}")
        chunk_span(0, cfg.chunk_tokens, block_size)  # refuses incompatible chunk/block sizes early
        self.cfg = cfg
        self.engine_id = engine_id
        self.model_id = model_id
        self.layout_fingerprint = layout_fingerprint
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self.node_id: str | None = None  # set when the worker's handshake arrives
        self.stats = SchedulerStats()
        factory = client_factory or MasterClient
        # Hot path client (lookup, publish) with the short bound; background client for the rest.
        self._hot = factory(cfg.master, token=cfg.token, timeout_s=cfg.lookup_timeout_s)
        self._bg = factory(cfg.master, token=cfg.token, timeout_s=cfg.master_timeout_s)
        self._hashers: dict[str, IncrementalHasher] = {}
        self._kept_out_reasons: set[str] = set()
        self.reader = ReaderPath(cfg, block_size=block_size, layout_fingerprint=layout_fingerprint,
                                 reader_id=f"{engine_id}-reader", hot=self._hot, bg=self._bg, stats=self.stats,
                                 hasher=self._hasher, own_node=lambda: self.node_id)
        self.holder = HolderPath(cfg, block_size=block_size, hot=self._hot, bg=self._bg, stats=self.stats)

    # ------------------------------------------------------------------ setup

    def bind_block_pool(self, pool: Any) -> None:
        self.holder.bind_block_pool(pool)

    def on_handshake(self, handshakes: Iterable[PdxferHandshake]) -> None:
        """Workers registered their KV with the transport: register the node, start holding."""
        for hs in handshakes:
            hs.check()
            if hs.layout_fingerprint != self.layout_fingerprint:
                raise LayoutError(f"worker {hs.node_id} reports KV layout {hs.layout_fingerprint}, the "
                                  f"scheduler derived {self.layout_fingerprint} from the config")
            if hs.rank != 0:
                continue
            self.node_id = hs.node_id
            if self.producer:
                self.holder.start(NodeInfo(node_id=hs.node_id, rank=hs.rank, transport=hs.transport,
                                           transport_metadata=hs.transport_metadata, layout=hs.layout,
                                           layout_fingerprint=hs.layout_fingerprint))

    def namespace(self, cache_salt: str | None) -> Namespace:
        return Namespace(self.model_id, self.layout_fingerprint, 1, 0, self.cfg.chunk_tokens, cache_salt)

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

    def update_state_after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.reader.update_state_after_alloc(req_id, block_ids, num_external_tokens)

    def build_connector_meta(self) -> PdxferConnectorMetadata:
        self.holder.drain_frees()
        return self.reader.take_metadata()

    # ------------------------------------------------------------------ holder (producer) path

    def request_finished(self, req_id: str, tokens: Sequence[int] | None, block_ids: Sequence[int],
                         cache_salt: str | None, unkeyable: str | None = None) -> int:
        """Publish every full chunk of a finished request and hold its blocks. ``tokens``: the
        tokens whose KV is in ``block_ids`` (None: nothing publishable, e.g. aborted);
        ``unkeyable``: why the tokens do not name this request's KV (then: no publish).
        Returns the leading tokens the queued publish covers (0: none)."""
        self.reader.finish_request(req_id)
        hasher = self._hashers.pop(req_id, None)
        if unkeyable is not None and self.producer and tokens is not None:
            self._keep_out(req_id, unkeyable)
            tokens = None
        if not self.producer:
            self.holder.drain_frees()
            return 0
        return self.holder.request_finished(req_id, tokens, block_ids, hasher,
                                            lambda: self._new_hasher(cache_salt))

    def _keep_out(self, req_id: str, reason: str) -> None:
        self.stats.unkeyable_requests += 1
        if reason not in self._kept_out_reasons:  # once per reason: a LoRA fleet would flood the log
            self._kept_out_reasons.add(reason)
            log.warning("pdxfer: request %s is kept out of KV transfer because %s (its token ids do not "
                        "name its KV); such requests are computed locally", req_id, reason)

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
        for c in (self._hot, self._bg):
            try:
                c.close()
            except Exception:
                pass
