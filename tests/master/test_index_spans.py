"""Lookups that read spans of published runs answer exactly what key-by-key lookups answer.

Two indexes get the same random operations: one reads spans (the default), the other key by key
(``spans=False``). Every publish, unpublish, lookup (hit, holders, block ids, lock) and release
must come out the same, through re-publishes with other blocks, retention running out, unpublished
chunks in the middle of a run, several holders of one prompt, skipped holders and dropped nodes.
"""

from __future__ import annotations

import random

import blake3

from pdxfer.master.server.index import ChunkIndex, UnknownNodeError
from pdxfer.master.wire.protocol import pack_u32

NODES = ["a", "b", "c"]


def _prompt_keys(prompt: int, n: int) -> list[bytes]:
    return [blake3.blake3(f"p{prompt}-{i}".encode()).digest() for i in range(n)]


def _same(spans: ChunkIndex, keyed: ChunkIndex, call: str, *args, **kwargs):
    outs = []
    for ix in (spans, keyed):
        try:
            outs.append(("ok", getattr(ix, call)(*args, **kwargs)))
        except UnknownNodeError as exc:
            outs.append(("unknown", exc.node_id))
    assert outs[0] == outs[1], (call, outs)
    return outs[0]


def _one_trial(rng: random.Random) -> int:
    spans, keyed = ChunkIndex(lock_prefix="t"), ChunkIndex(lock_prefix="t", spans=False)
    prompts = {p: _prompt_keys(p, rng.choice([3, 9, 40, 130])) for p in range(6)}
    now = 0.0
    locks: list[str] = []
    for _ in range(120):
        now += rng.choice([0.0, 0.05, 0.4, 1.2])
        op = rng.random()
        node = rng.choice(NODES)
        keys = prompts[rng.randrange(len(prompts))]
        if op < 0.08:
            # Both indexes hand out the same epochs only by luck: compare them by order instead.
            spans.register(node, "{}", rng.choice([2.0, 50.0]), now)
            keyed.register(node, "{}", spans.nodes[node].ttl, now)
            keyed.nodes[node].epoch = spans.nodes[node].epoch
        elif op < 0.14:
            _same(spans, keyed, "heartbeat", node, now)
        elif op < 0.42:
            start = rng.choice([0, 0, 0, rng.randrange(len(keys))])
            end = rng.randint(start + 1, len(keys))
            salt = rng.choice([0, 0, 1])  # 1: other block ids, refused where a lock pins the old ones
            # Block ids per chunk: the same for all, or a tail chunk with fewer or more, or ragged
            # (a run keeps its ids joined and slices them: every shape must slice right).
            shape = rng.choice(["even", "even", "tail_fewer", "tail_more", "ragged"])
            counts = [2] * (end - start)
            if shape == "tail_fewer":
                counts[-1] = 1
            elif shape == "tail_more":
                counts[-1] = 3
            elif shape == "ragged":
                counts = [rng.choice([1, 2, 3]) for _ in counts]
            items = [(k, pack_u32([3 * i + salt + b for b in range(c)]))
                     for (i, k), c in zip(enumerate(keys[start:end], start), counts)]
            if rng.random() < 0.1:
                items.append(items[0])  # a key twice in one publish
            _same(spans, keyed, "publish", node, items, rng.choice([None, None, 0.5, 3.0]), now)
        elif op < 0.72:
            want = keys[: rng.randint(1, len(keys))]
            if rng.random() < 0.2:  # keys nobody published after the held ones
                want = want + _prompt_keys(1000 + rng.randrange(3), 5)
            skip = {rng.choice(NODES): 0} if rng.random() < 0.15 else None
            ttl = rng.choice([0.3, 5.0])
            a = spans.lookup_and_lock(want, "r", ttl, now, skip=skip)
            b = keyed.lookup_and_lock(want, "r", ttl, now, skip=skip)
            assert (a.lock_id, a.hit, a.runs, a.counts, a.blocks) == (b.lock_id, b.hit, b.runs, b.counts, b.blocks)
            if a.lock_id:
                locks.append(a.lock_id)
        elif op < 0.82 and locks:
            _same(spans, keyed, "release", locks.pop(rng.randrange(len(locks))), now)
        elif op < 0.95:
            start = rng.randrange(len(keys))
            gone = keys[start : start + rng.choice([1, 1, 3, 20])]
            _same(spans, keyed, "unpublish_if_unlocked", node, gone, now)
        else:
            _same(spans, keyed, "deregister", node)
        if rng.random() < 0.2:
            spans.expire(now)
            keyed.expire(now)
        assert spans.snapshot() == keyed.snapshot()
    assert keyed.counters.span_chunks == 0
    return spans.counters.span_chunks, spans.counters.hit_chunks


def test_span_lookups_answer_exactly_what_key_by_key_lookups_answer():
    rng = random.Random(20261205)
    trials = [_one_trial(rng) for _ in range(150)]
    span_chunks, hit_chunks = sum(t[0] for t in trials), sum(t[1] for t in trials)
    print(f"{span_chunks} of {hit_chunks} hit chunks measured as spans")
    # The spans were read, not skipped: a good part of the chunks the lookups hit came from them.
    assert span_chunks > 0.3 * hit_chunks, (span_chunks, hit_chunks)
