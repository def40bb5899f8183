"""Which holder block and offset every reader token is loaded from: the reader's lookup and load
plan (``ReaderPath``) against lookups built by hand, checked token by token.

The oracle models what holder blocks really contain. Keys are a chain hash, so a chunk's key
names the whole prefix up to the chunk's end: a holder request found under chunk ``i``'s key
shares the reader's prompt at least up to there, and its blocks hold the reader's KV for every
token before the point where the two prompts part. A token loaded from anywhere else (another
request's tokens after the shared prefix, or the wrong position) is wrong KV.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdxfer.kv.keys import IncrementalHasher
from pdxfer.kv.layout import CPU, describe_kv_caches
from pdxfer.master import ChunkLocation, LookupResult, NodeInfo
from pdxfer.contracts.connector_config import parse_extra_config
from pdxfer.vllm.scheduler.reader import ReaderPath
from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats
from tests.unit.test_layout import make_caches


@functools.lru_cache(maxsize=None)
def _layout(block_size: int):
    return describe_kv_caches(make_caches(CPU, 2, 8, block_size, heads=2, head_dim=8))


@dataclass
class _Req:
    """One request a holder computed: its blocks, and how many leading tokens it shares with
    the reader's prompt (its KV is the reader's KV exactly there)."""

    node: str
    shared: int
    blocks: list[int]


@dataclass
class World:
    """Holders (node -> block size), the requests they computed, and what each block holds."""

    C: int
    holders: dict[str, int]
    reqs: list[_Req] = field(default_factory=list)
    owner: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # block -> (req, position)
    _next: dict[str, int] = field(default_factory=dict)

    def request(self, node: str, shared: int, length: int) -> int:
        """A holder request of ``length`` tokens sharing ``shared`` leading tokens with the prompt."""
        hb = self.holders[node]
        n = -(-length // hb)
        # Block ids far apart and descending: index arithmetic that mixes them up shows.
        base = self._next.get(node, 1000)
        ids = [base + 7 * (n - 1 - j) for j in range(n)]
        self._next[node] = base + 7 * n + 3
        self.reqs.append(_Req(node, shared, ids))
        j = len(self.reqs) - 1
        for pos, b in enumerate(ids):
            self.owner[(node, b)] = (j, pos)
        return j

    def location(self, j: int, tok0: int, tok1: int) -> ChunkLocation:
        """What the holder of request ``j`` publishes for tokens [tok0, tok1): the blocks holding them."""
        r = self.reqs[j]
        hb = self.holders[r.node]
        assert r.shared >= tok1, "the chain hash never finds a request that parted earlier"
        return ChunkLocation(b"k%d" % tok0, r.node, r.blocks[tok0 // hb: -(-tok1 // hb)])

    def node_infos(self) -> dict[str, NodeInfo]:
        out = {}
        for node, hb in self.holders.items():
            lay = _layout(hb)
            out[node] = NodeInfo(node, 0, "tcp", b"meta-" + node.encode(), lay.to_wire(), lay.fingerprint())
        return out


class _FakeMaster:
    def __init__(self) -> None:
        self.answer: LookupResult | None = None
        self.released: list[str] = []

    def lookup_and_lock(self, keys, reader, lock_ttl_s=None, parties=1, *, skip=None, transport=None,
                        prefer_tier=None):
        assert self.answer is not None
        res, self.answer = self.answer, None
        assert res.hit_chunks <= len(keys)
        return res

    def release(self, lock_id, all_parties=False):
        self.released.append(lock_id)


def make_reader(C: int, bs: int, master: _FakeMaster | None = None) -> ReaderPath:
    cfg = parse_extra_config({"master": "127.0.0.1:1", "transport": "tcp", "chunk_tokens": C})
    m = master or _FakeMaster()
    r = ReaderPath(cfg, block_size=bs, tp_size=1, total_kv_heads=2, reader_id="d-reader", hot=m, bg=m,
                   stats=SchedulerStats(), hasher=lambda req, salt: IncrementalHasher(C), own_node=lambda: None)
    r.set_local_layouts({0: _layout(bs)})
    return r


def plan(world: World, bs: int, n: int, locations: list[ChunkLocation], local: int = 0,
         rid: str = "d") -> tuple[int, list[int], Any]:
    """Look up (the master answers ``locations``) and plan a reader request of ``n`` tokens with
    ``local`` tokens already computed; (tokens offered, the request's block table, its LoadSpec)."""
    m = _FakeMaster()
    reader = make_reader(world.C, bs, m)
    m.answer = LookupResult("lock-1", len(locations), locations, world.node_infos(), 30.0)
    try:
        ext, _ = reader.get_num_new_matched_tokens(rid, list(range(n)), n, local, None)
        ext = ext or 0
        table = [500 + 3 * i for i in range(-(-n // bs))]
        if ext <= 0:
            return 0, table, None
        reader.update_state_after_alloc(rid, table, ext)
        meta = reader.take_metadata()
    finally:
        reader.close()
    assert len(meta.loads) == 1
    return ext, table, meta.loads[0]


def sources(world: World, bs: int, table: list[int], spec: Any) -> dict[tuple[int, int], tuple[str, int, int]]:
    """(reader block, offset) -> (holder node, holder block, offset) that the load writes there,
    as the worker executes the reads: whole blocks for reads without a holder block size, else
    exactly the read's token range. Two writes to one reader token are a race: refused."""
    out: dict[tuple[int, int], tuple[str, int, int]] = {}

    def put(lb: int, lo: int, src: tuple[str, int, int]) -> None:
        assert (lb, lo) not in out, f"two reads write reader block {lb} offset {lo}: {out[(lb, lo)]} and {src}"
        out[(lb, lo)] = src

    for r in spec.reads:
        hb = world.holders[r.node_id]
        if not r.remote_block_size:
            assert hb == bs, f"a whole-block read from {r.node_id} (block {hb}) into blocks of {bs}"
            assert len(r.remote_blocks) == len(r.local_blocks)
            for rb, lb in zip(r.remote_blocks, r.local_blocks):
                for o in range(bs):
                    put(lb, o, (r.node_id, rb, o))
            continue
        assert r.remote_block_size == hb
        for t in range(r.start, r.start + r.num_tokens):
            rb = r.remote_blocks[(t - r.remote_first_token) // hb]
            lb = r.local_blocks[(t - r.local_first_token) // bs]
            assert (t - r.local_first_token) // bs == table.index(lb) - r.local_first_token // bs
            put(lb, (t - r.local_first_token) % bs, (r.node_id, rb, (t - r.remote_first_token) % hb))
    return out


def check_load(world: World, bs: int, local: int, ext: int, table: list[int], spec: Any) -> None:
    """Every token the load promises is written once, from a holder block that holds exactly
    that token of this prompt; nothing is written below the tokens vLLM already has."""
    if ext == 0:
        return
    assert spec.reads, "tokens were offered but no read planned (the load fails and is recomputed)"
    got = sources(world, bs, table, spec)
    hit_end = local + ext
    for (lb, lo), (node, rb, ro) in got.items():
        t = table.index(lb) * bs + lo
        assert t >= local, f"token {t} is already computed here but the load writes it"
        assert lb in spec.blocks, f"reader block {lb} is written but not in the load's blocks"
        if t >= hit_end:
            continue  # vLLM computes these itself (the last block of a hit that ends inside it)
        j, pos = world.owner[(node, rb)]
        hb = world.holders[node]
        assert pos * hb + ro == t, f"token {t} comes from position {pos * hb + ro} of {node} block {rb}"
        assert t < world.reqs[j].shared, (
            f"token {t} comes from {node} block {rb}, a request that shares only {world.reqs[j].shared} "
            "tokens with this prompt: another request's KV")
    for t in range(local, hit_end):
        assert (table[t // bs], t % bs) in got, f"token {t} is promised but never written"


def _source_of(world: World, bs: int, table: list[int], spec: Any, t: int) -> tuple[str, int, int]:
    return sources(world, bs, table, spec)[(table[t // bs], t % bs)]


# ----------------------------------------------------------------------------- the case

def test_holder_block_larger_than_chunk_reads_only_this_prompts_block():
    """C 64, holder block 128, reader block 32. R1 published chunk 0 in its block X; R2 shares
    exactly 64 tokens, so chunk 0 stays on X and R2's chunk 1 is in R2's own block X'. Tokens
    0-127 must all come from X' (it holds R2's prefix through token 127), never 64-127 from X."""
    w = World(64, {"h": 128})
    r1 = w.request("h", 64, 256)
    r2 = w.request("h", 256, 256)
    locs = [w.location(r1, 0, 64), w.location(r2, 64, 128), w.location(r2, 128, 192), w.location(r2, 192, 256)]
    ext, table, spec = plan(w, 32, 256, locs)
    assert ext == 255
    check_load(w, 32, 0, ext, table, spec)
    for t in range(128):
        assert _source_of(w, 32, table, spec, t) == ("h", w.reqs[r2].blocks[0], t)


def test_holder_block_smaller_than_reader_block_takes_each_chunk_from_its_own_request():
    """C 64, holder block 32, reader block 128: each chunk's blocks are its own; R1's blocks
    serve tokens 0-63 only."""
    w = World(64, {"h": 32})
    r1 = w.request("h", 64, 200)
    r2 = w.request("h", 300, 300)
    locs = [w.location(r1, 0, 64), w.location(r2, 64, 128), w.location(r2, 128, 192)]
    ext, table, spec = plan(w, 128, 300, locs)
    assert ext == 128  # 192 rounded down to the reader's block
    check_load(w, 128, 0, ext, table, spec)
    assert _source_of(w, 128, table, spec, 40) == ("h", w.reqs[r1].blocks[1], 8)
    assert _source_of(w, 128, table, spec, 100) == ("h", w.reqs[r2].blocks[3], 4)


def test_same_block_size_last_chunk_of_a_block_wins():
    """pair_hit_blocks (every holder has the reader's block size, C 64, blocks of 128): a block
    listed by two chunks is read from the later chunk's holder block, which holds the prompt
    through that chunk's end; the earlier chunk's block (R1, parted at 64) is never read."""
    w = World(64, {"a": 128, "b": 128})
    r1 = w.request("a", 64, 128)
    r2 = w.request("b", 256, 256)
    locs = [w.location(r1, 0, 64), w.location(r2, 64, 128), w.location(r2, 128, 192), w.location(r2, 192, 256)]
    ext, table, spec = plan(w, 128, 256, locs)
    assert ext == 255
    check_load(w, 128, 0, ext, table, spec)
    assert {r.node_id for r in spec.reads} == {"b"}


def test_mixed_holders_of_two_block_sizes_into_small_reader_blocks():
    """Holder a (block 128) and b (block 32), reader block 32 (both staged): each token from a
    block that holds it."""
    w = World(64, {"a": 128, "b": 32})
    ra = w.request("a", 64, 128)  # a's request parted at 64: its block 0 is valid for 0-63 only
    rb = w.request("b", 400, 400)
    ra2 = w.request("a", 400, 400)
    locs = [w.location(ra, 0, 64), w.location(ra2, 64, 128), w.location(rb, 128, 192),
            w.location(ra2, 192, 256), w.location(rb, 256, 320)]
    ext, table, spec = plan(w, 32, 400, locs)
    assert ext == 320
    check_load(w, 32, 0, ext, table, spec)


def test_mixed_holders_where_a_whole_block_read_would_overlap_is_shortened():
    """Reader block 128: holder a's blocks (128) are read whole, b's (32) staged. Chunk 0 on a
    (a request parted at 64), chunk 1 on b: a whole-block read of a's block would write wrong
    tokens 64-127 into the block b's read writes too, so that block is not offered."""
    w = World(64, {"a": 128, "b": 32})
    ra = w.request("a", 64, 128)
    rb = w.request("b", 400, 400)
    locs = [w.location(ra, 0, 64), w.location(rb, 64, 128), w.location(rb, 128, 192), w.location(rb, 192, 256)]
    ext, table, spec = plan(w, 128, 400, locs)
    check_load(w, 128, 0, ext, table, spec)
    assert ext == 0  # a's block is the only source of tokens 0-63 and cannot be read whole


# ----------------------------------------------------------------------------- the property

@st.composite
def hit_case(draw: Any) -> tuple[World, int, int, int, list[ChunkLocation]]:
    """A prompt, holders of random block sizes, and a lookup answer obeying the chain property:
    chunk i's location is a request sharing the prompt at least through chunk i's end (the tail:
    one that computed this very prompt)."""
    C = draw(st.sampled_from([32, 64]))
    sizes = [s for s in (16, 32, 64, 128, 256) if s % C == 0 or C % s == 0]
    bs = draw(st.sampled_from(sizes))
    holders = {f"n{i}": draw(st.sampled_from(sizes)) for i in range(draw(st.integers(1, 3)))}
    w = World(C, holders)
    n = draw(st.integers(2, 7 * C))
    local = draw(st.integers(0, (n - 2) // bs)) * bs
    first = local // C
    full = n // C
    tail = n % C
    want = full - first + (1 if tail else 0)
    if want <= 0:
        local, first, want = 0, 0, full + (1 if tail else 0)
    hit = draw(st.integers(1, want))
    locs = []
    reqs: list[int] = []
    for i in range(first, first + hit):
        tok0 = i * C
        is_tail = i == full
        tok1 = n if is_tail else tok0 + C
        ok = [j for j in reqs if w.reqs[j].shared >= (n if is_tail else tok1)]
        if ok and draw(st.booleans()):
            j = draw(st.sampled_from(ok))
        else:
            node = draw(st.sampled_from(sorted(holders)))
            shared = n if is_tail else draw(st.integers(tok1, n))
            length = n if is_tail else draw(st.integers(shared, n + C))
            j = w.request(node, shared, length)
            reqs.append(j)
        locs.append(w.location(j, tok0, tok1))
    return w, bs, n, local, locs


def _expected_ext(w: World, bs: int, n: int, local: int, locs: list[ChunkLocation]) -> int:
    """What an exact plan offers: every hit token, rounded down to the reader's blocks unless
    the hit reaches the prompt's last token (computed here)."""
    end = min(local // w.C * w.C + len(locs) * w.C, n)
    if end >= n - 1:
        end = n - 1
    else:
        end -= end % bs
    return max(end - local, 0)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=hit_case())
def test_every_loaded_token_comes_from_a_block_that_holds_it(case):
    w, bs, n, local, locs = case
    ext, table, spec = plan(w, bs, n, locs, local)
    check_load(w, bs, local, ext, table, spec)
    # Shortening is only for what cannot be served exactly: holders that are all read whole or
    # all staged give the whole hit.
    direct = {hb == bs for hb in (w.holders[loc.node_id] for loc in locs)}
    if len(direct) == 1:
        assert ext == _expected_ext(w, bs, n, local, locs)


# ----------------------------------------------------------------------------- holder descriptions

def _described(meta: Any, spec: Any, node_id: str) -> Any:
    """The holder description the worker uses for ``spec``'s reads from ``node_id``."""
    holders = getattr(spec, "holders", None)
    if holders is not None:
        return {h.node_id: h for h in holders}[node_id]
    return meta.nodes[node_id]  # metadata before version 5: one description per node and step


def test_two_loads_in_one_step_name_their_own_registration_of_a_node():
    """Issue 16 hole 5, against a real master: request d1 looked up node h at its first
    registration, h re-registered (a new process), d2 looked up h's new registration; both are
    planned in one step. Each load must carry the description its own lookup returned, or d1's
    block ids are read from the new process (or d2's from the old one, still alive)."""
    from pdxfer.master import MasterClient, start_local_master

    C, bs = 64, 64
    lay = _layout(bs)
    m = start_local_master()
    try:
        with MasterClient(m.address) as p1, MasterClient(m.address) as p2, MasterClient(m.address) as hot:
            reader = make_reader(C, bs, _FakeMaster())
            reader._hot = reader._bg = hot
            t1, t2 = list(range(1, 2 * C + 2)), list(range(5000, 5000 + 2 * C + 2))
            p1.register_node(NodeInfo("h", 0, "tcp", b"epoch-1", lay.to_wire(), lay.fingerprint()), 30.0)
            p1.publish("h", [(k, [i]) for i, k in enumerate(IncrementalHasher(C).update(t1))], retention_s=30.0)
            assert reader.get_num_new_matched_tokens("d1", t1, len(t1), 0, None) == (2 * C, True)
            p2.register_node(NodeInfo("h", 0, "tcp", b"epoch-2", lay.to_wire(), lay.fingerprint()), 30.0)
            p2.publish("h", [(k, [i + 10]) for i, k in enumerate(IncrementalHasher(C).update(t2))], retention_s=30.0)
            assert reader.get_num_new_matched_tokens("d2", t2, len(t2), 0, None) == (2 * C, True)
            reader.update_state_after_alloc("d1", [40, 41, 42], 2 * C)
            reader.update_state_after_alloc("d2", [50, 51, 52], 2 * C)
            meta = reader.take_metadata()
            reader.close()
    finally:
        m.stop()
    by_req = {s.req_id: s for s in meta.loads}
    assert by_req["d1"].reads[0].remote_blocks == (0, 1) and by_req["d2"].reads[0].remote_blocks == (10, 11)
    assert _described(meta, by_req["d1"], "h").transport_metadata == b"epoch-1"
    assert _described(meta, by_req["d2"], "h").transport_metadata == b"epoch-2"
    meta.check()
