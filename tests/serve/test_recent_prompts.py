"""The per-instance estimate of recently routed prompts, and how the router weighs it against the
index (no sockets here: the proxy's path through it is in test_routing.py)."""

from __future__ import annotations

import pytest

from pdxfer.serve.backends import BackendPool
from pdxfer.serve.index_view import Holding
from pdxfer.serve.recent_prompts import RecentPrompts, block_chain
from pdxfer.serve.router import RouteConfig, Router


def test_a_block_chain_names_each_whole_block_with_everything_before_it() -> None:
    a = list(range(100))
    b = a[:48] + [7] + a[49:]  # differs in block 3 (tokens 48..63)
    ca, cb = block_chain(a, 16), block_chain(b, 16)
    assert len(ca) == 6  # the 4-token partial block is not named
    assert ca[:3] == cb[:3] and all(x != y for x, y in zip(ca[3:], cb[3:]))
    # The same block after another history is another block.
    assert block_chain(a[16:32], 16)[0] != ca[1]


def test_the_longest_prefix_counts_leading_blocks_recorded_for_that_instance() -> None:
    r = RecentPrompts(capacity_tokens=1024, block_tokens=16)
    turn1 = list(range(100))
    turn2 = turn1 + list(range(500, 560))
    r.record("http://d0", r.chain(turn1))
    assert r.longest_prefix("http://d0", r.chain(turn2)) == 96
    assert r.longest_prefix("http://d1", r.chain(turn2)) == 0
    assert r.longest_prefix("http://d0", r.chain([1] + turn1)) == 0
    r.forget("http://d0")
    assert r.longest_prefix("http://d0", r.chain(turn2)) == 0


def test_room_runs_out_at_the_capacity_tails_first() -> None:
    r = RecentPrompts(capacity_tokens=10 * 16, block_tokens=16)
    old = list(range(8 * 16))
    new = list(range(1000, 1000 + 4 * 16))
    r.record("u", r.chain(old))
    r.record("u", r.chain(new))
    assert r.blocks("u") == 10
    # The old prompt lost its last two blocks, its head is still there.
    assert r.longest_prefix("u", r.chain(old)) == 6 * 16
    assert r.longest_prefix("u", r.chain(new)) == 4 * 16
    huge = list(range(5000, 5000 + 30 * 16))
    r.record("u", r.chain(huge))  # longer than the capacity: its head is what is kept
    assert r.blocks("u") == 10 and r.longest_prefix("u", r.chain(huge)) == 10 * 16
    assert not RecentPrompts(0).enabled and RecentPrompts(0).chain(huge) == []
    with pytest.raises(ValueError, match="block_tokens"):
        RecentPrompts(100, 0)
    with pytest.raises(ValueError, match="capacity_tokens"):
        RecentPrompts(-1)
    with pytest.raises(ValueError, match="recent_prompt_tokens"):
        RouteConfig(recent_prompt_tokens=-1)


def _router(**cfg: int) -> Router:
    prefill = BackendPool.from_urls("prefill", ["http://p0:1", "http://p1:1"], "least_loaded")
    decode = BackendPool.from_urls("decode", ["http://d0:1", "http://d1:1"], "least_loaded")
    for b in prefill.backends + decode.backends:
        b.healthy = True
    return Router(prefill, decode, index=None, cfg=RouteConfig(**cfg))


def test_an_index_tie_goes_to_the_instance_that_was_sent_the_prompts_head() -> None:
    """Both decodes hold the system prompt's two chunks in the index; d1 was sent turn 1. Turn 2
    goes to d1 although d0 is idler, and with 120 tokens left the prefill is skipped; without the
    history the idler d0 is chosen and 488 tokens are left, so a prefill runs."""
    tokens = list(range(1000))
    held = Holding(prompt_tokens=1000, held_tokens=512,
                   by_url={"http://d0:1": 512, "http://d1:1": 512})
    for recent in (0, 1 << 20):
        router = _router(recent_prompt_tokens=recent)
        router.decode.backends[1].in_flight = 1
        router.recent.record("http://d1:1", router.recent.chain(tokens[:880]))
        route = router.decide(held, router.recent.chain(tokens))
        if recent:
            assert (route.decode.url, route.prefill, route.reason) == ("http://d1:1", None, "skip-prefill")
            assert route.reason_header() == "skip-prefill; decode=holder; held=512/1000; own=880; left=120"
        else:
            assert (route.decode.url, route.reason) == ("http://d0:1", "least-loaded")
            assert route.prefill is not None and route.prefill.url == "http://p0:1"


def test_a_busy_instance_is_passed_over_whatever_it_was_sent() -> None:
    tokens = list(range(1000))
    router = _router(holder_max_extra_load=2, skip_prefill_tokens=16)
    chain = router.recent.chain(tokens)
    router.recent.record("http://d1:1", chain)
    router.recent.record("http://p1:1", chain)
    router.decode.backends[1].in_flight = router.prefill.backends[1].in_flight = 3
    route = router.decide(Holding(1000, 0, {}), chain)
    assert (route.decode.url, route.decode_reason) == ("http://d0:1", "least-loaded")
    assert route.prefill is not None and (route.prefill.url, route.reason) == ("http://p0:1", "least-loaded")
    router.decode.backends[1].in_flight = router.prefill.backends[1].in_flight = 2
    route = router.decide(Holding(1000, 0, {}), chain)
    assert (route.decode.url, route.reason, route.detail) == ("http://d1:1", "skip-prefill", "own=992; left=8")
