"""Random operation sequences on the index, checked against a small reference model."""

from __future__ import annotations

import random

from pdxfer.master.server.index import ChunkIndex, UnknownNodeError
from pdxfer.master.wire.protocol import pack_u32, unpack_u32


def test_index_matches_reference_model():
    rng = random.Random(7)
    keys = [bytes([i]) * 32 for i in range(8)]
    nodes = ["a", "b", "c"]
    for trial in range(30):
        ix = ChunkIndex()
        now = 0.0
        # model state
        alive: dict[str, float] = {}  # node -> lease end
        ttl = {n: rng.choice([1.0, 3.0, 100.0]) for n in nodes}
        held: dict[tuple[str, int], list[int]] = {}  # (node, chunk) -> blocks
        locks: dict[str, tuple[float, set[tuple[str, int]], set[str]]] = {}  # id -> (deadline, pins, nodes)

        def model_drop(n: str) -> None:
            alive.pop(n, None)
            for k in [k for k in held if k[0] == n]:
                del held[k]
            for lid in [lid for lid, (_, _, ns) in locks.items() if n in ns]:
                del locks[lid]

        def valid_lock_on(k: tuple[str, int]) -> bool:
            return any(d > now and k in pins for d, pins, _ in locks.values())

        for step in range(60):
            now += rng.choice([0.0, 0.1, 0.5, 1.5])
            for n in [n for n, end in alive.items() if end <= now]:
                model_drop(n)
            op = rng.random()
            n = rng.choice(nodes)
            if op < 0.15:
                ix.register(n, "{}", ttl[n], now)
                model_drop(n)
                alive[n] = now + ttl[n]
            elif op < 0.25:
                ok = ix.heartbeat(n, now) is not None
                assert ok == (n in alive), (trial, step)
                if ok:
                    alive[n] = now + ttl[n]
            elif op < 0.5:
                chunks = rng.sample(range(8), rng.randint(1, 8))
                items = [(keys[c], pack_u32([c * 10 + rng.randint(0, 1)])) for c in chunks]
                try:
                    acc = ix.publish(n, items, None, now)
                    assert n in alive
                except UnknownNodeError:
                    assert n not in alive
                    continue
                exp = 0
                for c, (_, blob) in zip(chunks, items):
                    b = unpack_u32(blob)
                    if (n, c) in held and held[(n, c)] != b and valid_lock_on((n, c)):
                        continue
                    held[(n, c)] = b
                    exp += 1
                assert acc == exp, (trial, step)
            elif op < 0.75:
                want = rng.randint(1, 8)
                out = ix.lookup_and_lock(keys[:want], "r", rng.choice([0.2, 2.0]), now)
                exp_hit = 0
                while exp_hit < want and any((m, exp_hit) in held for m in alive):
                    exp_hit += 1
                assert out.hit == exp_hit, (trial, step, out.hit, exp_hit)
                got_blocks = unpack_u32(out.blocks)
                i = 0
                pins = set()
                for nid, run in out.runs:
                    for _ in range(run):
                        assert held[(nid, i)] == [got_blocks[i]]
                        pins.add((nid, i))
                        i += 1
                if out.lock_id:
                    locks[out.lock_id] = (ix.locks[out.lock_id].deadline, pins, {nid for nid, _ in out.runs})
            elif op < 0.88 and locks:
                lid = rng.choice(list(locks))
                d, _, _ = locks.pop(lid)
                assert ix.release(lid, now) == (d > now), (trial, step)
            else:
                chunks = rng.sample(range(8), rng.randint(1, 4))
                try:
                    removed = ix.unpublish_if_unlocked(n, [keys[c] for c in chunks], now)
                    assert n in alive
                except UnknownNodeError:
                    assert n not in alive
                    continue
                exp = [i for i, c in enumerate(chunks) if (n, c) not in held or not valid_lock_on((n, c))]
                assert removed == exp, (trial, step, removed, exp)
                for i in exp:
                    held.pop((n, chunks[i]), None)
            if rng.random() < 0.3:  # the reaper: afterwards the counts must agree exactly
                ix.expire(now)
                assert ix.n_entries == len(held), (trial, step)
                assert ix.held_blocks == sum(map(len, held.values())), (trial, step)
                assert set(ix.nodes) == set(alive), (trial, step)
