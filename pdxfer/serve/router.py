"""Where a request goes: a prefill instance (or none) and a decode instance, and why.

With an index view (the master's read-only index) the router learns how many leading prompt
tokens the fleet already holds and where:

- **skip the prefill** when what is left to compute (prompt minus what the chosen decode can load
  or already holds in its own prefix cache) is at
  most ``skip_prefill_tokens`` or ``skip_prefill_fraction`` of the prompt: the decode loads the
  held prefix and computes the rest itself (reason ``skip-prefill``; ``short-prompt`` when nothing
  is held and the whole prompt is that short);
- else prefill on the instance holding the longest prefix (its own prefix cache hits:
  ``prefill-holder``), else the least loaded (``least-loaded``);
- decode on the decode instance holding the longest prefix (``holder``), else the least loaded;
  a holder is passed over while it has more than ``holder_max_extra_load`` requests in flight
  beyond the least loaded instance of its role (a hot prefix must not pin all its traffic to one);
  with none healthy, one that is out is tried all the same (``last-resort``): a slow health check
  must not turn every request away, and an instance that is really gone is named in the error.

"Holding" counts two sources: the index (exact, whole chunks only, what any reader can load) and
the prompts recently routed to each instance (recent_prompts.py: an estimate of its own prefix
cache, block by block). The second is what sends a conversation's next turn to the instance that
served its last one, when several hold only its shared system prompt in whole chunks.

Tiers: the held tokens past the longest prefix some holder's KV cache (device tier) holds are held
only in host tiers. They count as loadable only while the chosen decode did not measure loads
from a host tier to be slower per token than its own prefill (load_costs.py: what its load gate
exports); else they count as left to compute (``host=<tokens> recompute`` in the reason).

Without an index, or when it cannot answer in time, the request is routed as if nothing were held
and the reason says why (``no-index``, ``index-down``, ``tokenize-failed``, ...). No healthy prefill
instance: the decode computes the prompt (``no-prefill``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import aiohttp

from pdxfer.serve.backends import Backend, BackendPool
from pdxfer.serve.index_view import Holding, IndexUnavailable, IndexView
from pdxfer.serve.load_costs import LoadCostScraper
from pdxfer.serve.recent_prompts import RecentPrompts
from pdxfer.serve.prompt_tokens import TokenizeError, prompt_tokens, single_prompt

log = logging.getLogger("pdxfer.proxy")

DECISIONS = ("prefill+decode", "decode-only")
MAX_REASON_CHARS = 400


@dataclass(frozen=True)
class RouteConfig:
    skip_prefill_tokens: int = 256
    skip_prefill_fraction: float = 0.0  # 0: only the token count decides
    index_timeout_s: float = 1.0  # tokenize + peek, together
    # A holder is preferred only while it has at most this many more requests in flight than
    # the least loaded healthy instance of its role: reuse must not pile a hot prefix's whole
    # traffic onto one instance while the others idle.
    holder_max_extra_load: int = 2
    # Per instance, how many tokens of recently routed prompts count as held by its own prefix
    # cache (0: only the index counts), and at what block granularity.
    recent_prompt_tokens: int = 1 << 18
    recent_block_tokens: int = 16

    def __post_init__(self) -> None:
        if self.skip_prefill_tokens < 0:
            raise ValueError(f"skip_prefill_tokens must not be negative, got {self.skip_prefill_tokens}")
        if not 0.0 <= self.skip_prefill_fraction <= 1.0:
            raise ValueError(f"skip_prefill_fraction must be in [0, 1], got {self.skip_prefill_fraction}")
        if self.index_timeout_s <= 0:
            raise ValueError(f"index_timeout_s must be positive, got {self.index_timeout_s}")
        if self.holder_max_extra_load < 0:
            raise ValueError(f"holder_max_extra_load must not be negative, got {self.holder_max_extra_load}")
        if self.recent_prompt_tokens < 0:
            raise ValueError(f"recent_prompt_tokens must not be negative, got {self.recent_prompt_tokens}")
        if self.recent_block_tokens <= 0:
            raise ValueError(f"recent_block_tokens must be positive, got {self.recent_block_tokens}")


@dataclass
class Route:
    decode: Backend
    prefill: Backend | None
    reason: str  # why this prefill (or none): a short code, also a metrics label
    decode_reason: str  # "holder" | "least-loaded"
    prompt_tokens: int | None = None
    held_tokens: int | None = None
    detail: str = ""

    @property
    def decision(self) -> str:
        return DECISIONS[0] if self.prefill is not None else DECISIONS[1]

    def route_header(self) -> str:
        if self.prefill is None:
            return f"decode-only={self.decode.url}"
        return f"prefill={self.prefill.url} decode={self.decode.url}"

    def reason_header(self) -> str:
        parts = [self.reason, f"decode={self.decode_reason}"]
        if self.prompt_tokens is not None and self.held_tokens is not None:
            parts.append(f"held={self.held_tokens}/{self.prompt_tokens}")
        if self.detail:
            parts.append(self.detail)
        # A header value: one printable line, bounded (details quote instances' error bodies).
        text = "; ".join(parts)
        text = "".join(c if c.isprintable() and c.isascii() else " " for c in text)
        return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


class NoHealthyInstance(Exception):
    def __init__(self, pool: BackendPool) -> None:
        super().__init__(f"no healthy {pool.role} instance ({pool.describe_down()})")
        self.pool = pool


def _holder(pool: BackendPool, by_url: Mapping[str, int], max_extra_load: int) -> tuple[Backend, int] | None:
    """The healthy instance of ``pool`` holding the longest prefix (ties: least loaded), among
    those with at most ``max_extra_load`` more requests in flight than the least loaded."""
    healthy = pool.healthy()
    if not healthy:
        return None
    bound = min(b.in_flight for b in healthy) + max_extra_load
    best: tuple[Backend, int] | None = None
    for b in healthy:
        if b.in_flight > bound:
            continue
        n = by_url.get(b.url, 0)
        if n > 0 and (best is None or n > best[1] or (n == best[1] and b.in_flight < best[0].in_flight)):
            best = (b, n)
    return best


class Router:
    def __init__(self, prefill: BackendPool, decode: BackendPool, index: IndexView | None,
                 cfg: RouteConfig | None = None, costs: LoadCostScraper | None = None) -> None:
        """``costs``: each decode instance's measured load and prefill costs (None: none known,
        every held token counts, whatever its tier)."""
        self.prefill = prefill
        self.decode = decode
        self.index = index
        self.cfg = cfg or RouteConfig()
        self.costs = costs
        self.recent = RecentPrompts(self.cfg.recent_prompt_tokens, self.cfg.recent_block_tokens)

    def forget(self, b: Backend) -> None:
        """``b`` was taken out: it may come back restarted, its prefix cache empty."""
        self.recent.forget(b.url)

    def _least_loaded_decode(self) -> tuple[Backend, str]:
        picked = self.decode.pick()
        if picked is not None:
            return picked, "least-loaded"
        picked = self.decode.pick(last_resort=True)
        if picked is None:  # only with an empty pool, which the proxy refuses
            raise NoHealthyInstance(self.decode)
        return picked, "last-resort"

    def _plain(self, reason: str, detail: str = "", prompt_tokens: int | None = None) -> Route:
        """Nothing known about what the fleet holds: least loaded on both sides."""
        decode, decode_reason = self._least_loaded_decode()
        prefill = self.prefill.pick()
        if prefill is None:
            return Route(decode, None, "no-prefill", decode_reason, prompt_tokens, None,
                         f"{reason}: {detail}" if detail else reason)
        return Route(decode, prefill, reason, decode_reason, prompt_tokens, None, detail)

    async def route(self, session: aiohttp.ClientSession, path: str, body: Mapping[str, Any],
                    headers: Mapping[str, str]) -> Route:
        """The route of one request (with no healthy decode instance, one that is out:
        ``decode=last-resort``)."""
        if self.index is None:
            return self._plain("no-index")
        if not path.endswith("/chat/completions") and single_prompt(body) is None:
            return self._plain("multi-prompt")
        if body.get("cache_salt") is not None:
            return self._plain("cache-salt", "the index knows unsalted namespaces only")
        if "prompt_embeds" in body:
            return self._plain("unkeyable", "prompt embeddings have no token ids")
        try:
            tokens, holding = await asyncio.wait_for(self._holding(session, path, body, headers),
                                                     self.cfg.index_timeout_s)
        except asyncio.TimeoutError:
            return self._plain("index-timeout", f"no answer within {self.cfg.index_timeout_s:g} s")
        except TokenizeError as e:
            return self._plain("tokenize-failed", str(e))
        except IndexUnavailable as e:
            return self._plain(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - the index is advice: it never fails a request
            log.exception("asking the index failed unexpectedly")
            return self._plain("index-error", f"{e.__class__.__name__}: {e}")
        chain = self.recent.chain(tokens)
        route = self.decide(holding, chain)
        self.recent.record(route.decode.url, chain)
        if route.prefill is not None:
            self.recent.record(route.prefill.url, chain)
        return route

    async def _holding(self, session: aiohttp.ClientSession, path: str, body: Mapping[str, Any],
                       headers: Mapping[str, str]) -> tuple[list[int], Holding]:
        assert self.index is not None
        via = self.decode.pick() or self.prefill.pick()
        if via is None:
            raise TokenizeError("no healthy instance to tokenize with")
        tokens = await prompt_tokens(session, via.url, path, body, headers, self.cfg.index_timeout_s)
        # The master client blocks (bounded by its own timeout): off the event loop.
        return list(tokens), await asyncio.to_thread(self.index.holding, tokens)

    def _own_cache(self, pool: BackendPool, h: Holding, chain: Sequence[int]) -> dict[str, int]:
        """url -> leading prompt tokens each healthy instance of ``pool`` holds itself: what the
        index says, or what was recently routed there, whichever is longer."""
        out: dict[str, int] = {}
        for b in pool.healthy():
            n = max(h.by_url.get(b.url, 0), self.recent.longest_prefix(b.url, chain))
            if n > 0:
                out[b.url] = min(n, h.prompt_tokens)
        return out

    def decide(self, h: Holding, chain: Sequence[int] = ()) -> Route:
        """The route for a prompt of which the fleet holds ``h`` and whose block hashes (in
        :class:`RecentPrompts`) are ``chain``."""
        decode_own = self._own_cache(self.decode, h, chain)
        decode_held = _holder(self.decode, decode_own, self.cfg.holder_max_extra_load)
        if decode_held is not None:
            decode, decode_reason = decode_held[0], "holder"
        else:
            decode, decode_reason = self._least_loaded_decode()
        P = h.prompt_tokens
        own = decode_own.get(decode.url, 0)
        # What the decode need not compute: what it can load, or already holds itself. At most
        # all but the last prompt token (it samples from that one). What only host tiers hold it
        # loads only while that was not measured slower than computing it (its load gate
        # declines such a load too: counting it would skip a prefill the decode then does).
        route = Route(decode, None, "", decode_reason, P, h.held_tokens)
        loadable = h.held_tokens
        host = h.held_tokens - max(h.device_held, own)  # held only in host tiers, not here
        if host > 0 and self._host_slower(decode):
            loadable = h.device_held
            route.detail = f"host={host} recompute"
        ready = max(loadable, own)
        left = P - min(ready, P - 1)
        if ready > h.held_tokens:
            route.detail = f"own={ready}"
        if left <= self.cfg.skip_prefill_tokens or left <= self.cfg.skip_prefill_fraction * P:
            route.reason = "skip-prefill" if ready > 0 else "short-prompt"
            route.detail = "; ".join(filter(None, (route.detail, f"left={left}")))
            return route
        holder = _holder(self.prefill, self._own_cache(self.prefill, h, chain),
                         self.cfg.holder_max_extra_load)
        if holder is not None:
            route.prefill, route.reason = holder[0], "prefill-holder"
            return route
        route.prefill = self.prefill.pick()
        route.reason = "least-loaded" if route.prefill is not None else "no-prefill"
        return route

    def _host_slower(self, decode: Backend) -> bool:
        """Whether ``decode`` measured loading from a host tier slower per token than computing
        (False when it measured nothing: as without measurements, every held token counts)."""
        c = self.costs.get(decode.url) if self.costs is not None else None
        return c is not None and c.host_slower_than_compute() is True
