"""The scheduler's load-or-recompute gate: feeds ``load_benefit.BenefitModel`` what this instance
measures (its loads, its prefill steps) and trims each hit to the prefix that pays to load.

Measured where vLLM tells the scheduler, so every number includes what a user waits for:

* a load, from the step whose metadata handed it to the workers to the step output that reports
  it finished (``finished_recving``), with the bytes it read per holder;
* a prefill step, from building its metadata to its output, with the tokens it scheduled; only
  steps that computed more than one token for some request count (a decode-only step says
  nothing about prefill speed).

What it measured is exported too, per prompt token (``gauges``: a typical load from each tier's
best holder, this instance's prefill), for the proxy's router to weigh tiers the same way.

Off unless ``load_benefit`` is set: then every hit is loaded, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdxfer.contracts.connector_metric_defs import COMPUTE_COST_KEY, COST_KEYS, LOAD_COST_KEYS
from pdxfer.vllm.scheduler.host_slots import serves_from_host
from pdxfer.vllm.scheduler.load_benefit import (DEVICE_TIER, HOST_TIER, LOAD, PARTIAL, RECOMPUTE, BenefitModel, Decision, Piece,
                                       holder_key)

log = logging.getLogger("pdxfer.vllm")

_MAX_PENDING = 4096  # loads handed out and not yet reported (bounded: a lost report must not grow it)


@dataclass
class _Pending:
    per_holder: dict[Any, int]  # holder key -> bytes
    posted_at: float | None = None


class LoadGate:
    def __init__(self, margin: float, stats: Any) -> None:
        self.model = BenefitModel(margin=margin)
        self.stats = stats
        self.bytes_per_token = 0  # this engine's KV bytes per token (all ranks); 0: unknown yet
        self._pending: dict[str, _Pending] = {}
        self._step: tuple[float, int] | None = None  # (built at, tokens) of a prefill step in flight
        # The tier this reader measured faster (None: no preference): what its lookups ask the
        # master to prefer. Set on the scheduler thread, read by the lookup poller's.
        self.preferred_tier: str | None = None
        # What the gate measured, per prompt token, as the vllm:pdxfer_load_benefit_*_per_token
        # gauges (stats key -> seconds; 0: not measured): a router weighs tiers by them.
        self.costs: dict[str, float] = dict.fromkeys(COST_KEYS, 0.0)

    def set_bytes_per_token(self, layouts: Iterable[Any], block_size: int) -> None:
        """From the workers' layouts (``KVLayout`` per rank): what one token of KV is here."""
        self.bytes_per_token = sum(int(lay.bytes_per_block) for lay in layouts) // max(block_size, 1)

    # ------------------------------------------------------------------ decisions

    def pieces(self, locations: Sequence[Any], nodes: Mapping[str, Any], local: int, first_chunk: int,
               chunk_tokens: int, tail_tokens: int, n_full: int, last: int) -> list[Piece]:
        """Each usable chunk of a hit as it would be loaded: holder and tier (``nodes``: the
        lookup's node info, whose layout tells host slots apart), its tokens in ``[local,
        last)`` (the last prompt token is always computed here), bytes."""
        out = []
        for i, loc in enumerate(locations):
            c = first_chunk + i
            end = (c + 1) * chunk_tokens if c < n_full else c * chunk_tokens + tail_tokens
            tokens = max(min(end, last) - max(c * chunk_tokens, local), 0)
            node = nodes.get(loc.node_id)
            host = node is not None and serves_from_host(loc.block_ids, node.layout)
            out.append(Piece(holder_key(loc.node_id, HOST_TIER if host else DEVICE_TIER), tokens,
                             tokens * self.bytes_per_token))
        return out

    def decide(self, req_id: str, pieces: Sequence[Piece]) -> Decision:
        d = self.model.decide(pieces)
        if d.kind == LOAD:
            self.stats.load_benefit_loads += 1
        elif d.kind == PARTIAL:
            self.stats.load_benefit_partials += 1
        else:
            self.stats.load_benefit_recomputes += 1
        self.stats.load_benefit_declined_tokens += d.declined_tokens
        log.debug("pdxfer: %s: %s %d of %d offered tokens (load all %s, chosen %s, recompute all %s): %s",
                  req_id, d.kind, d.tokens, d.offered, _ms(d.load_all_s), _ms(d.chosen_s),
                  _ms(d.recompute_all_s), d.why)
        if d.kind != LOAD:
            # Declined tokens are computed, not lost: say why once per request at info.
            log.info("pdxfer: %s: computing %d of the %d held tokens here (%s)", req_id,
                     d.declined_tokens, d.offered, d.why)
        return d

    def planned(self, req_id: str, pieces: Sequence[Piece]) -> None:
        """``pieces`` are this request's load: measure it when it is handed out and reported."""
        per: dict[Any, int] = {}
        for p in pieces:
            per[p.holder] = per.get(p.holder, 0) + p.nbytes
        if len(self._pending) >= _MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        self._pending[req_id] = _Pending(per)

    def dropped(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    # ------------------------------------------------------------------ what vLLM reports

    def step_built(self, scheduled_tokens: Mapping[str, int] | None, handed_out: Iterable[str],
                   now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for req_id in handed_out:
            p = self._pending.get(req_id)
            if p is not None and p.posted_at is None:
                p.posted_at = now
        tokens = dict(scheduled_tokens or {})
        self._step = (now, sum(tokens.values())) if tokens and max(tokens.values()) > 1 else None

    def step_output(self, finished_recving: Iterable[str] | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._step is not None:
            built_at, tokens = self._step
            self.model.observe_step(tokens, now - built_at)
            self._step = None
            # Cheap (a sum over a short window), so fresh after every prefill step.
            self.costs[COMPUTE_COST_KEY] = self.model.compute_s_per_token() or 0.0
        observed = False
        for req_id in finished_recving or ():
            p = self._pending.pop(req_id, None)
            if p is None or p.posted_at is None:
                continue
            for holder, nbytes in p.per_holder.items():
                # Reads from several holders run side by side: each took at most the load's time.
                self.model.observe_load(holder, nbytes, now - p.posted_at)
                observed = True
        if observed:
            tier = self.model.faster_tier()
            if tier != self.preferred_tier:
                what = f"prefer holders' {tier} tier" if tier else "prefer no tier"
                log.info("pdxfer: lookups now %s (measured loads, latency s and s/byte per holder/tier: %s)",
                         what, self.model.snapshot().get("holders"))
                self.preferred_tier = tier
            # Here, not per step: fitting every holder's line is the costly part, and it changes
            # only with a load.
            per_token = self.model.load_s_per_token(self.bytes_per_token)
            for t, key in LOAD_COST_KEYS.items():
                self.costs[key] = per_token.get(t, 0.0)

    def gauges(self) -> dict[str, float]:
        """The measured costs (COST_KEYS -> seconds per prompt token; 0: not measured)."""
        return dict(self.costs)


def _ms(s: float | None) -> str:
    return "?" if s is None else f"{s * 1e3:.1f} ms"


__all__ = ["LoadGate", "LOAD", "PARTIAL", "RECOMPUTE"]
