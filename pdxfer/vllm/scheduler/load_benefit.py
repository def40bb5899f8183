"""Load or recompute: which prefix of a hit pays to load, from what this reader measured.

Pure (no clock, no I/O): the scheduler half feeds it observations and asks it for decisions.

* Each holder, per tier (``(node_id, tier)``: ``"device"`` for KV cache blocks, ``"host"`` for a
  chunk its host tier serves; one holder's two tiers are measured apart), has a small
  window of its completed loads as this reader saw them: (bytes, seconds from handing the load to
  the workers to vLLM being told it finished). A line ``seconds = latency + bytes * s_per_byte``
  is fitted to them; when every load had about the same size the latency cannot be told apart
  and all of the time counts per byte.
* This instance's prefill throughput comes from its own steps: tokens scheduled in a step that
  computed more than one token for some request, over the time to the next step.
* For a hit of chunks ``0..K-1``, loading the first ``k`` costs the slowest of their holders
  (reads from several holders run side by side): ``max_h(latency_h + bytes_h(k) * s_per_byte_h)``,
  and recomputing the rest ``(n - tokens(k)) / throughput``. The ``k`` with the least expected
  time is taken only when it beats loading the whole hit by more than ``margin`` (relative), so
  noise around the break-even keeps loading.
* Cold start (a holder in the hit never measured, or too few prefill steps): load everything,
  which is also how a holder gets measured. A holder declined ``probe_every`` times in a row is
  loaded from once more, so one that got faster is seen again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from pdxfer.kv.tiers import DEVICE_TIER, HOST_TIER

HolderKey = tuple[str, str]  # (node id, tier)

LOAD, PARTIAL, RECOMPUTE = "load", "partial", "recompute"
DECISIONS = (LOAD, PARTIAL, RECOMPUTE)


def holder_key(node_id: str, tier: str | None = None) -> HolderKey:
    return (node_id, tier or DEVICE_TIER)


@dataclass(frozen=True)
class Piece:
    """One chunk of a hit as it would be loaded: who serves it, how many tokens beyond what is
    local, and how many bytes that is for this reader."""

    holder: HolderKey
    tokens: int
    nbytes: int


@dataclass(frozen=True)
class Decision:
    kind: str  # LOAD, PARTIAL or RECOMPUTE
    chunks: int  # leading pieces to load (all of them for LOAD, 0 for RECOMPUTE)
    tokens: int  # tokens those pieces carry
    load_all_s: float | None  # expected time of loading the whole hit (None: not estimable)
    chosen_s: float | None  # expected time of the choice (load part, recompute the rest)
    recompute_all_s: float | None  # expected time of recomputing the whole hit
    why: str
    offered: int = 0  # tokens the hit offered

    @property
    def declined_tokens(self) -> int:
        return self.offered - self.tokens


class HolderCost:
    """The last ``window`` completed loads of one holder and tier."""

    def __init__(self, window: int) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, nbytes: int, seconds: float) -> None:
        self.samples.append((max(int(nbytes), 0), max(float(seconds), 0.0)))

    def fit(self) -> tuple[float, float] | None:
        """(latency s, seconds per byte) or None before the first sample."""
        if not self.samples:
            return None
        xs = [b for b, _ in self.samples]
        ys = [s for _, s in self.samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        # Sizes spread enough (the largest at least 1.5x the smallest) tell latency from bandwidth.
        if n >= 2 and min(xs) > 0 and max(xs) >= 1.5 * min(xs) and var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
            if slope > 0:
                lat = my - slope * mx
                if lat >= 0:
                    return lat, slope
                return 0.0, sum(ys) / sum(xs)
            return my, 0.0  # time does not grow with size: all of it is latency
        total_b = sum(xs)
        if total_b <= 0:
            return my, 0.0
        return 0.0, sum(ys) / total_b

    def expected_s(self, nbytes: int) -> float | None:
        f = self.fit()
        if f is None:
            return None
        return f[0] + f[1] * nbytes


class PrefillRate:
    """This instance's own prefill throughput over its last ``window`` prefill steps."""

    def __init__(self, window: int, min_steps: int) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_steps = min_steps

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))

    def tokens_per_s(self) -> float | None:
        """None until ``min_steps`` steps were seen (then: load, and learn)."""
        if len(self.samples) < self.min_steps:
            return None
        secs = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / secs if secs > 0 else None


@dataclass
class BenefitModel:
    margin: float = 0.25
    window: int = 16
    min_steps: int = 4
    probe_every: int = 32
    holders: dict[HolderKey, HolderCost] = field(default_factory=dict)
    rate: PrefillRate | None = None
    _declines: dict[HolderKey, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if self.window < 1 or self.min_steps < 1 or self.probe_every < 1:
            raise ValueError(f"window, min_steps and probe_every must be >= 1, got {self.window}, "
                             f"{self.min_steps}, {self.probe_every}")
        if self.rate is None:
            self.rate = PrefillRate(self.window, self.min_steps)

    # ------------------------------------------------------------------ observations

    def observe_load(self, holder: HolderKey, nbytes: int, seconds: float) -> None:
        """A load that read ``nbytes`` from ``holder`` and ended ``seconds`` after it was handed
        to the workers (a failed load too: that is what it cost)."""
        cost = self.holders.get(holder)
        if cost is None:
            if len(self.holders) >= 1024:  # bounded: holders come and go over a long life
                del self.holders[next(iter(self.holders))]
            cost = self.holders[holder] = HolderCost(self.window)
        cost.add(nbytes, seconds)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A prefill step computed ``tokens`` in ``seconds``."""
        assert self.rate is not None
        self.rate.add(tokens, seconds)

    # ------------------------------------------------------------------ decisions

    def _best_by_tier(self) -> tuple[int, dict[str, float]]:
        """(a typical load of this reader: the mean size of its measured loads, in bytes; tier ->
        the expected seconds of such a load from that tier's best measured holder)."""
        sizes = [b for cost in self.holders.values() for b, _ in cost.samples]
        if not sizes:
            return 0, {}
        typical = sum(sizes) // len(sizes)
        best: dict[str, float] = {}
        for (_, tier), cost in self.holders.items():
            t = cost.expected_s(typical)
            if t is not None:
                best[tier] = min(best.get(tier, t), t)
        return typical, best

    def load_s_per_token(self, bytes_per_token: int) -> dict[str, float]:
        """tier -> expected seconds per prompt token of a typical load (as in :meth:`faster_tier`)
        from that tier's best measured holder: what a router compares with
        :meth:`compute_s_per_token`. A tier never measured is absent, and so is every tier while
        the KV bytes per token or the typical load's size is unknown (0)."""
        typical, best = self._best_by_tier()
        if bytes_per_token <= 0 or typical <= 0:
            return {}
        tokens = typical / bytes_per_token
        return {tier: s / tokens for tier, s in best.items()}

    def compute_s_per_token(self) -> float | None:
        """Seconds this instance takes to prefill one prompt token (1 / its measured throughput);
        None until ``min_steps`` prefill steps were seen."""
        assert self.rate is not None
        tps = self.rate.tokens_per_s()
        return 1.0 / tps if tps else None

    def faster_tier(self) -> str | None:
        """The tier whose best measured holder would load a typical load of this reader (the mean
        size of its measured loads) sooner by more than ``margin``; None until both tiers are
        measured, or when neither is clearly faster."""
        _, best = self._best_by_tier()
        if DEVICE_TIER not in best or HOST_TIER not in best:
            return None
        device, host = best[DEVICE_TIER], best[HOST_TIER]
        if host * (1 + self.margin) < device:
            return HOST_TIER
        if device * (1 + self.margin) < host:
            return DEVICE_TIER
        return None

    def load_s(self, pieces: Sequence[Piece]) -> float | None:
        """Expected time of loading ``pieces`` (0 for none; None when a holder is unmeasured)."""
        per: dict[HolderKey, int] = {}
        for p in pieces:
            per[p.holder] = per.get(p.holder, 0) + p.nbytes
        worst = 0.0
        for h, nbytes in per.items():
            cost = self.holders.get(h)
            t = cost.expected_s(nbytes) if cost is not None else None
            if t is None:
                return None
            worst = max(worst, t)
        return worst

    def decide(self, pieces: Sequence[Piece]) -> Decision:
        """How many leading ``pieces`` to load."""
        pieces = list(pieces)
        n = sum(p.tokens for p in pieces)
        K = len(pieces)

        def made(kind: str, k: int, full: float | None, chosen: float | None, rec: float | None,
                 why: str) -> Decision:
            return Decision(kind, k, sum(p.tokens for p in pieces[:k]), full, chosen, rec, why, offered=n)

        if K == 0:
            return made(LOAD, 0, 0.0, 0.0, 0.0, "nothing offered")
        assert self.rate is not None
        tps = self.rate.tokens_per_s()
        full = self.load_s(pieces)
        if tps is None:
            return made(LOAD, K, full, full, None, f"cold start: {len(self.rate.samples)} of "
                        f"{self.min_steps} prefill steps measured")
        rec_all = n / tps
        if full is None:
            return made(LOAD, K, None, None, rec_all, "a holder of the hit was never measured")
        best_k, best = K, full
        for k in range(K - 1, -1, -1):
            t = self.load_s(pieces[:k])
            assert t is not None
            done = sum(p.tokens for p in pieces[:k])
            t += (n - done) / tps
            if t < best:
                best_k, best = k, t
        if best_k == K or best * (1.0 + self.margin) >= full:
            for h in {p.holder for p in pieces}:
                self._declines.pop(h, None)
            return made(LOAD, K, full, full, rec_all, "loading pays" if best_k == K else
                        f"declining saves less than the margin ({self.margin:.0%})")
        declined = {p.holder for p in pieces[best_k:]}
        probed = [h for h in declined if self._declines.get(h, 0) + 1 >= self.probe_every]
        if probed:
            for h in declined:
                self._declines.pop(h, None)
            return made(LOAD, K, full, full, rec_all, f"re-measuring {sorted(probed)} after "
                        f"{self.probe_every} declines")
        for h in declined:
            self._declines[h] = self._declines.get(h, 0) + 1
        kind = RECOMPUTE if best_k == 0 else PARTIAL
        return made(kind, best_k, full, best, rec_all, f"expected {best * 1e3:.1f} ms against "
                    f"{full * 1e3:.1f} ms loading all at {tps:.0f} tokens/s")

    def snapshot(self) -> dict[str, object]:
        """What the model believes now (for logs and tests)."""
        assert self.rate is not None
        return {"tokens_per_s": self.rate.tokens_per_s(),
                "holders": {f"{h[0]}/{h[1]}": c.fit() for h, c in self.holders.items()}}
