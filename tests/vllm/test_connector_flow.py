"""Both connector halves without an engine: a real master process, vLLM's real BlockPool, real
KV-shaped tensors and the real TCP transport between a holder and a reader in one process.

Fast (seconds) and exercises every decision the connector makes: keys, lookup, plan, read,
validate at release, load errors, retention, locks vs. unpublish, the held-blocks cap.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from pdxfer.kv.layout import describe_kv_caches  # noqa: E402
from pdxfer.master import start_local_master  # noqa: E402
from pdxfer.contracts.connector_config import TEST_HOOKS_ENV, parse_extra_config  # noqa: E402
from pdxfer.contracts.publish_hint import hinted_tokens, prompt_digest, publish_hint  # noqa: E402
from tests.vllm.conftest import finish_request, wait_until  # noqa: E402
from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402
from pdxfer.vllm.worker.worker_side import WorkerSide  # noqa: E402

BS = 128  # vLLM CPU default block size
C = 256
NUM_BLOCKS = 32
LAYERS = 3


def _kv(seed: int | None, block_size: int = BS) -> dict[str, torch.Tensor]:
    """CPU backend shape: per layer [num_blocks, kv_heads, block_size, 2*head_dim], views of one buffer."""
    buf = torch.zeros(LAYERS, NUM_BLOCKS, 2, block_size, 2 * 16, dtype=torch.bfloat16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.copy_(torch.randn(buf.shape, generator=g).to(torch.bfloat16))
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}




class Node:
    """One instance's worth of connector state: scheduler half + worker half + block pool."""

    def __init__(self, name: str, master_addr: str, producer: bool, consumer: bool, seed: int | None,
                 block_size: int = BS, **extra):
        self.bs = block_size
        self.kv = _kv(seed, block_size)
        layout = describe_kv_caches(self.kv, block_size=block_size)
        self.fp = layout.fingerprint()
        # A generous publish wait: these tests look up right after a request finished.
        self.cfg = parse_extra_config({"master": master_addr, "transport": "tcp", "publish_wait_s": 2.0, **extra})
        self.pool = BlockPool(NUM_BLOCKS, True, block_size)
        self.sched = SchedulerSide(self.cfg, engine_id=name, model_id="tiny", layout_fingerprint=self.fp,
                                   content_fingerprint=layout.content_fingerprint(layout.kv_heads),
                                   total_kv_heads=layout.kv_heads, block_size=block_size, producer=producer,
                                   consumer=consumer)
        self.sched.bind_block_pool(self.pool)
        self.worker = WorkerSide(self.cfg, node_id=f"{name}-r0", rank=0, expected_fingerprint=self.fp,
                                 block_size=block_size)
        self.sched.on_handshake([self.worker.register_kv_caches(self.kv)])

    def finish(self, rid: str, tokens: list[int]) -> tuple[list[int], int]:
        """A request that computed ``tokens`` locally, then finished: (block ids, tokens published)."""
        return finish_request(self.sched, self.pool, self.bs, rid, tokens)

    def run_request(self, rid: str, tokens: list[int]) -> list[int]:
        return self.finish(rid, tokens)[0]

    def load(self, rid: str, tokens: list[int], local: int = 0, timeout: float = 10.0):
        """Scheduler + worker path of one reader request; returns (ext tokens, local ids, errors)."""
        ext, is_async = self.sched.get_num_new_matched_tokens(rid, tokens, len(tokens), local, None)
        if ext == 0:
            return 0, [], set()
        assert is_async
        blocks = self.pool.get_new_blocks(-(-len(tokens) // self.bs))
        ids = [b.block_id for b in blocks]
        self.sched.update_state_after_alloc(rid, ids, ext)
        self.worker.start_loads(self.sched.build_connector_meta())
        deadline = time.monotonic() + timeout
        while rid not in self.worker.get_finished():
            assert time.monotonic() < deadline, "load never finished"
            time.sleep(0.005)
        return ext, ids, self.worker.take_load_errors()

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (n,), generator=g).tolist()


def _same_blocks(a: Node, a_ids, b: Node, b_ids) -> bool:
    return all(torch.equal(a.kv[n][x], b.kv[n][y]) for n in a.kv for x, y in zip(a_ids, b_ids))


@pytest.fixture
def pair(master):
    nodes: list[Node] = []

    def make(**extra):
        h = Node(f"holder{len(nodes)}", master.address, True, False, seed=len(nodes) + 1, **extra)
        r = Node(f"reader{len(nodes)}", master.address, False, True, seed=None, **extra)
        nodes.extend([h, r])
        return h, r

    yield make
    for n in nodes:
        n.close()


def test_read_moves_exact_blocks_and_never_the_whole_prompt(pair):
    # A cap with room for every request here: at the default (16 of 32 blocks) the holder keeps
    # room for one more 7-block request and reclaims p1 before d4 asks for it.
    holder, reader = pair(max_held_fraction=0.9)
    toks = _tokens(3 * C + 10, 1)
    h_ids = holder.run_request("p1", toks)
    # 3 chunks = 6 blocks, and the 10-token tail in a 7th (issue 12: the tail moves too).
    assert holder.pool.get_num_free_blocks() == NUM_BLOCKS - 1 - 7
    ext, r_ids, errors = reader.load("d1", toks)
    assert ext == 3 * C + 9 and not errors  # every prompt token but the last
    assert _same_blocks(holder, h_ids[:7], reader, r_ids[:7])  # the partial block moves whole
    assert reader.worker.stats.tokens_loaded == 3 * C + 9

    # A prompt of exactly two chunks (no tail): both load, the last token is computed here.
    toks2 = _tokens(2 * C, 2)
    holder.run_request("p2", toks2)
    ext2, _, errors2 = reader.load("d2", toks2)
    assert ext2 == 2 * C - 1 and not errors2
    # A prompt shorter than one chunk: its tail alone, chained from the namespace root.
    toks3 = _tokens(100, 20)
    h3 = holder.run_request("p3", toks3)
    ext3, r3, errors3 = reader.load("d3", toks3)
    assert ext3 == 99 and not errors3 and _same_blocks(holder, h3[:1], reader, r3[:1])
    # The same prompt with another last token: its tail key differs, only full chunks match.
    ext4, _, _ = reader.load("d4", toks[:-1] + [toks[-1] + 1])
    assert ext4 == 3 * C


def test_local_prefix_is_skipped_and_keys_isolate_salt(pair):
    holder, reader = pair()
    toks = _tokens(4 * C + 1, 3)
    h_ids = holder.run_request("p", toks)
    # vLLM already has the first 3 blocks locally (block aligned, mid-chunk): read the rest only.
    ext, r_ids, errors = reader.load("d", toks, local=3 * BS)
    assert ext == 4 * C - 3 * BS and not errors
    assert _same_blocks(holder, h_ids[3:8], reader, r_ids[3:8])
    assert not any(torch.equal(holder.kv[n][h_ids[0]], reader.kv[n][r_ids[0]]) for n in holder.kv)
    # Same tokens under another cache salt: different keys, no hit.
    ext_salt, _ = reader.sched.get_num_new_matched_tokens("s", toks, len(toks), 0, "other-salt")
    assert ext_salt == 0


def test_unkeyable_requests_are_neither_looked_up_nor_published(pair):
    """Issue 9, hole 3: a request whose KV its tokens do not name (LoRA, images, embeddings)."""
    holder, reader = pair()
    toks = _tokens(2 * C + 5, 21)
    blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
    holder.sched.request_finished("p-lora", toks, [b.block_id for b in blocks], None,
                                  unkeyable="it uses a LoRA adapter")
    holder.pool.free_blocks(blocks)
    assert holder.sched.held_chunks == 0  # nothing published for the adapter's KV
    holder.run_request("p", toks)  # the same tokens without the adapter: published
    assert holder.sched.held_chunks == 3  # 2 chunks and the tail
    # A reader with an adapter must not take the base model's chunks for the same tokens.
    assert reader.sched.get_num_new_matched_tokens("d-lora", toks, len(toks), 0, None,
                                                   unkeyable="it uses a LoRA adapter") == (0, False)
    assert reader.sched.stats.lookups == 0 and reader.sched.stats.unkeyable_requests == 1
    assert reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)[0] == 2 * C + 4


def test_expired_lock_turns_into_load_errors(pair, tmp_path, monkeypatch):
    holder, reader = pair()
    toks = _tokens(2 * C + 5, 4)
    holder.run_request("p", toks)
    (tmp_path / "lock_ttl_s").write_text("0.6")
    (tmp_path / "read_delay_s").write_text("1.2")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == 2 * C + 4
    assert errors == set(r_ids[:5])
    assert reader.worker.stats.loads_failed == 1 and reader.worker.stats.loads_ok == 0
    # vLLM asks again for the request it must now recompute: one attempt only, no retry loop.
    assert reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None) == (0, False)


def test_dead_holder_turns_into_load_errors(pair):
    holder, reader = pair()
    toks = _tokens(2 * C + 5, 5)
    holder.run_request("p", toks)
    holder.worker.transport.close()  # the holder's KV server is gone; the master still lists it
    t0 = time.monotonic()
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == 2 * C + 4 and errors == set(r_ids[:5])
    assert time.monotonic() - t0 < 5


def test_unreachable_master_means_zero_hits_quickly(master):
    r = Node("lonely", "127.0.0.1:1", False, True, seed=None, lookup_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert r.sched.get_num_new_matched_tokens("x", _tokens(3 * C, 6), 3 * C, 0, None) == (0, False)
        assert time.monotonic() - t0 < 2.0
        assert r.sched.stats.master_errors == 1
    finally:
        r.close()


def test_retention_frees_blocks_but_not_while_locked(pair):
    holder, reader = pair(retention_s=0.5, lock_ttl_s=3.0)
    toks = _tokens(C + 3, 7)
    holder.run_request("p", toks)
    free_before = holder.pool.get_num_free_blocks()
    # A reader locks the chunk (lookup) and does not finish: retention passes, the chunk stays.
    ext, _ = reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)
    assert ext == C + 2
    time.sleep(1.2)
    holder.sched.drain_frees()
    assert holder.pool.get_num_free_blocks() == free_before and holder.sched.held_chunks == 2
    # Lock released (request aborted before allocation): the reaper unpublishes, blocks come back.
    reader.sched.request_finished("d", None, [], None)
    wait_until(lambda: not holder.sched.held_chunks, "held chunk never freed after its lock went away", 5)
    holder.sched.drain_frees()
    assert holder.pool.get_num_free_blocks() == free_before + 3  # the chunk's 2 blocks + the tail's
    assert reader.sched.get_num_new_matched_tokens("d2", toks, len(toks), 0, None) == (0, False)


def test_held_share_is_capped(pair):
    holder, _ = pair(max_held_fraction=0.25)  # 8 of 32 blocks
    cap = int(0.25 * NUM_BLOCKS)
    for i in range(4):  # 4 requests x 3 chunks x 2 blocks = 24 blocks wanted
        holder.run_request(f"p{i}", _tokens(3 * C + 1, 10 + i))
        assert holder.sched.held_blocks <= cap
    # Room is made in the background (never on the step path): the reclaim lands shortly.
    wait_until(lambda: holder.sched.stats.pressure_reclaims, "no pressure reclaim happened", 5)
    holder.sched.drain_frees()
    assert holder.pool.get_num_free_blocks() >= NUM_BLOCKS - 1 - cap


def test_at_the_cap_each_new_request_is_still_published_whole(pair):
    # A P/D decode wants the whole prompt its prefill just computed. At the cap, the holder used to
    # reclaim only when a request did not fit, and published just its leading chunks meanwhile:
    # every few requests a decode recomputed most of its prompt. It must keep room ahead.
    holder, _ = pair(max_held_fraction=0.75)  # 24 of 32 blocks; a request holds 7
    cap = int(0.75 * NUM_BLOCKS)
    partial = []
    for i in range(8):
        toks = _tokens(3 * C + 1, 60 + i)
        _, published = holder.finish(f"p{i}", toks)
        assert holder.sched.held_blocks <= cap
        if published != len(toks):
            partial.append(i)
        # Between requests (an engine step or more) the background reclaim lands.
        wait_until(lambda: not holder.sched.holder.cap.reclaiming, "reclaim never finished", 5, poll=0.005)
        holder.sched.drain_frees()
    assert not partial, f"requests {partial} were published only in part"


def _finish_load(node: Node, rid: str, timeout: float = 5.0) -> set[int]:
    node.worker.start_loads(node.sched.build_connector_meta())
    deadline = time.monotonic() + timeout
    while rid not in node.worker.get_finished():
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.005)
    return node.worker.take_load_errors()


def test_unplannable_or_unknown_loads_fail_every_expected_block(pair):
    holder, reader = pair()
    toks = _tokens(2 * C + 5, 8)
    holder.run_request("p", toks)
    ext, _ = reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)
    assert ext == 2 * C + 4
    ids = [b.block_id for b in reader.pool.get_new_blocks(3)]
    # vLLM hands over a range we cannot map onto whole blocks: nothing is read, all of it fails.
    reader.sched.update_state_after_alloc("d", ids, ext - 1)
    assert _finish_load(reader, "d") == set(ids)
    # vLLM expecting a load the connector never offered must not hang: every block fails.
    reader.sched.update_state_after_alloc("ghost", ids, C)
    assert _finish_load(reader, "ghost") == set(ids)


def test_chunks_the_master_lost_are_freed_after_the_stale_bound(pair, master):
    from pdxfer.master import MasterClient

    holder, _ = pair(retention_s=0.3)
    holder.sched.holder.stale_after_s_override = 1.0  # normally max(10 x the master's lock TTL cap, 60 s)
    toks = _tokens(2 * C + 1, 9)
    free_before = holder.pool.get_num_free_blocks()
    holder.run_request("p", toks)
    assert holder.pool.get_num_free_blocks() == free_before - 5  # 2 chunks and a 1-token tail
    # The master forgets the entries behind the holder's back: unpublish now says "not removed".
    with MasterClient(master.address) as c:
        keys = holder.sched.namespace(None).chunk_hashes(toks)
        assert len(c.unpublish_if_unlocked(holder.worker.node_id, keys)) == 2
    wait_until(lambda: not holder.sched.held_chunks, "chunks unknown to the master were never freed", poll=0.1)
    holder.sched.drain_frees()
    assert holder.pool.get_num_free_blocks() == free_before


def test_kv_both_never_reads_from_itself(master):
    both = Node("both", master.address, True, True, seed=3)
    try:
        toks = _tokens(2 * C + 1, 12)
        both.run_request("p", toks)
        assert both.sched.held_chunks == 3
        # Its own chunks are in its local prefix cache already; a read from itself is refused.
        assert both.sched.get_num_new_matched_tokens("q", toks, len(toks), 0, None) == (0, False)
    finally:
        both.close()


@pytest.fixture
def frozen_master_pair():
    """A holder and a reader on a master of their own, which the test may freeze (SIGSTOP)."""
    m = start_local_master()
    nodes: list[Node] = []

    def make(**extra):
        h = Node("fh", m.address, True, False, seed=31, **extra)
        r = Node("fr", m.address, False, True, seed=None, **extra)
        nodes.extend([h, r])
        return h, r

    try:
        yield m, make
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
        for n in nodes:
            n.close()
        m.stop()


def test_a_frozen_master_never_blocks_the_workers_step(frozen_master_pair):
    """Issue 9, hole 10: validating a load at the master (release) must not hold vLLM's step."""
    m, make = frozen_master_pair
    holder, reader = make()
    toks = _tokens(2 * C + 5, 32)
    holder.run_request("p", toks)
    ext, _ = reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)
    assert ext == 2 * C + 4
    blocks = reader.pool.get_new_blocks(-(-len(toks) // BS))
    reader.sched.update_state_after_alloc("d", [b.block_id for b in blocks], ext)
    os.kill(m.proc.pid, signal.SIGSTOP)  # the read still works; the release cannot be answered
    reader.worker.start_loads(reader.sched.build_connector_meta())
    slowest, deadline = 0.0, time.monotonic() + 10
    while True:
        t0 = time.perf_counter()
        finished = reader.worker.get_finished()
        slowest = max(slowest, time.perf_counter() - t0)
        if "d" in finished:
            break
        assert time.monotonic() < deadline, "the load never ended"
        time.sleep(0.005)
    assert slowest < 0.05, f"get_finished blocked the step for {slowest * 1e3:.0f} ms"
    assert reader.worker.take_load_errors()  # unvalidated bytes are never used


def test_a_frozen_master_never_blocks_request_finished_at_the_cap(frozen_master_pair):
    """Issue 9, hole 10: making room under the held cap (an unpublish) must not hold the step."""
    m, make = frozen_master_pair
    holder, _ = make(max_held_fraction=0.25, publish_wait_s=0.05)  # 8 of 32 blocks
    for i in range(2):  # 2 x 3 chunks x 2 blocks: the cap is reached
        holder.run_request(f"p{i}", _tokens(3 * C + 1, 40 + i))
    os.kill(m.proc.pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    holder.run_request("p-more", _tokens(3 * C + 1, 50))  # wants room: a reclaim is due
    took = time.perf_counter() - t0
    assert took < 0.05 + 0.1, f"request_finished blocked the step for {took * 1e3:.0f} ms"
    assert holder.sched.held_blocks <= 8


def test_the_reaper_survives_an_unexpected_error(pair, monkeypatch):
    """Issue 9, hole 10: one unexpected exception in the reaper must not stop held blocks from
    ever being returned (it used to end the thread silently)."""
    holder, _ = pair(retention_s=0.3)
    real = holder.sched.holder._unpublish
    calls = []

    def flaky(client, keys):
        calls.append(len(keys))
        if len(calls) == 1:
            raise RuntimeError("injected: a bug in the reaper's path")
        return real(client, keys)

    monkeypatch.setattr(holder.sched.holder, "_unpublish", flaky)
    holder.run_request("p", _tokens(C + 3, 60))
    wait_until(lambda: not holder.sched.held_chunks, "held chunk never freed after the reaper hit an error")
    assert len(calls) >= 2 and holder.sched.stats.background_errors == 1


def test_a_departed_holders_connection_is_dropped(pair):
    """Issue 9, hole 10: a reader keeps no connection (socket, NIXL agent) to a holder whose
    read failed because it is gone; a later load reconnects on its own."""
    holder, reader = pair()
    toks = _tokens(2 * C + 5, 61)
    holder.run_request("p", toks)
    assert reader.load("d1", toks)[0] == 2 * C + 4
    assert reader.worker.connected_holders() == [holder.worker.node_id]
    holder.worker.transport.close()  # gone; the master still lists it until its lease ends
    toks2 = toks[:C] + _tokens(C + 5, 62)
    holder.run_request("p2", toks2)
    ext, _, errors = reader.load("d2", toks2)
    assert ext > 0 and errors  # the read failed: the holder is gone
    assert reader.worker.connected_holders() == []


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
@pytest.mark.parametrize("hb,rb", [(128, 64), (64, 256), (256, 32)])
def test_a_reader_with_another_block_size_loads_exact_tokens(master, hb, rb, transport):
    """Issue 11: holder and reader blocks of different sizes, both directions: whole holder
    blocks are READ into staging and scattered by token range into the reader's blocks."""
    from tests.unit.test_convert import tokens_kv

    holder = Node(f"h{hb}{transport}", master.address, True, False, seed=70, block_size=hb,
                  publish_wait_s=2.0, transport=transport)
    reader = Node(f"r{rb}{transport}", master.address, False, True, seed=None, block_size=rb,
                  transport=transport)
    try:
        toks = _tokens(2 * C + 77, 71 + hb)  # 2 chunks and a tail
        h_ids = holder.run_request("p", toks)
        ext, r_ids, errors = reader.load("d", toks)
        assert ext == len(toks) - 1 and not errors
        got = tokens_kv(reader.kv, r_ids, rb, 0, ext)
        assert torch.equal(got, tokens_kv(holder.kv, h_ids, hb, 0, ext))
        assert reader.worker.stats.tokens_loaded == ext
    finally:
        reader.close()
        holder.close()


def test_a_superseded_holder_stops_publishing_and_returns_its_blocks(pair, master):
    """Issue 9, hole 2 (holder side): another process registers our node id; the master dropped
    our entries and their locks, so everything held goes back to vLLM and nothing more is published."""
    from pdxfer.master import MasterClient, NodeInfo

    holder, reader = pair(lease_ttl_s=1.5)  # heartbeats every 0.5 s
    toks = _tokens(2 * C + 5, 80)
    free_before = holder.pool.get_num_free_blocks()
    holder.run_request("p", toks)
    assert holder.sched.held_chunks == 3
    with MasterClient(master.address) as other:  # the other process, same node id
        other.register_node(NodeInfo(holder.worker.node_id, 0, "tcp", b"{}", {"block_size": BS}, holder.fp),
                            lease_ttl_s=30.0)
        wait_until(lambda: not holder.sched.held_chunks, "a superseded holder kept its blocks")
        holder.sched.drain_frees()
        assert holder.pool.get_num_free_blocks() == free_before
        holder.run_request("p2", _tokens(2 * C + 5, 81))
        assert holder.sched.held_chunks == 0  # publishes nothing as a node it no longer is


def _ask_until_answered(reader: Node, rid: str, toks: list[int], hint: int, bound_s: float):
    """vLLM's loop: ask again (next step) while the connector answers None; (answer, Nones, s)."""
    t0 = time.monotonic()
    nones = 0
    while True:
        ext, is_async = reader.sched.get_num_new_matched_tokens(rid, toks, len(toks), 0, None,
                                                                hinted_tokens=hint)
        if ext is not None:
            return (ext, is_async), nones, time.monotonic() - t0
        nones += 1
        assert time.monotonic() - t0 < bound_s, "the connector kept vLLM waiting past its bound"
        time.sleep(0.001)


def test_a_decode_waits_for_the_publish_its_prefill_announced(pair, tmp_path, monkeypatch):
    # Issue 12: the prefill no longer waits for its publish on its TTFT path (publish_wait_s 0),
    # so a decode's lookup can come first. The hint in kv_transfer_params makes it wait, bounded.
    holder, reader = pair(publish_wait_s=0.0)
    (tmp_path / "publish_delay_s").write_text("0.15")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    toks = _tokens(2 * C + 40, 31)
    t0 = time.monotonic()
    _, hint = holder.finish("p", toks)
    assert time.monotonic() - t0 < 0.1  # the prefill did not wait for its (slow) publish
    assert hint == len(toks)  # two full chunks and the 40-token tail
    assert publish_hint(hint, len(toks), C, toks) == {"pdxfer": {"v": 2, "hints": [
        {"prompt": prompt_digest(toks), "published_tokens": len(toks)}]}}
    assert hinted_tokens(publish_hint(hint, len(toks), C, toks), toks) == hint
    assert hinted_tokens({"do_remote_prefill": True}, toks) == 0 and hinted_tokens(None, toks) == 0
    # A prefill that also generated: its tail key names generated tokens the decode does not
    # have, so only the full chunks inside the prompt are announced.
    assert hinted_tokens(publish_hint(len(toks) + 11, len(toks), C, toks), toks) == 2 * C
    assert publish_hint(len(toks) + 11, C - 5, C, toks) is None

    # Without the hint the lookup beats the publish and finds nothing: the race the hint closes.
    assert reader.sched.get_num_new_matched_tokens("d0", toks, len(toks), 0, None) == (0, False)
    (ext, is_async), nones, took = _ask_until_answered(reader, "d1", toks, hint, bound_s=1.0)
    assert (ext, is_async) == (len(toks) - 1, True) and nones > 0
    assert 0.05 < took < 0.25 + 0.1
    assert reader.sched.stats.publish_hint_waits == 1 and reader.sched.stats.publish_hint_timeouts == 0
    # Waiting costs master round trips at most every couple of ms, not one per engine spin.
    assert reader.sched.stats.lookups <= 2 + took / 0.002
    reader.sched.reader.drop_lookup("d1")

    # A prefill that generated 11 tokens published a tail the decode's prompt does not have: the
    # hint announces only the full chunks, so the decode does not wait for that tail.
    monkeypatch.delenv(TEST_HOOKS_ENV)
    toks2 = _tokens(2 * C + 40, 35)
    _, published = holder.finish("p2", toks2 + _tokens(11, 36))
    hint2 = hinted_tokens(publish_hint(published, len(toks2), C, toks2), toks2)
    (ext2, _), _, _ = _ask_until_answered(reader, "d2", toks2, hint2, bound_s=1.0)
    assert ext2 == 2 * C and reader.sched.stats.publish_hint_timeouts == 0


def test_a_hinted_publish_that_never_lands_costs_only_the_bound(pair, tmp_path, monkeypatch):
    holder, reader = pair(publish_wait_s=0.0, publish_hint_wait_s=0.2)
    (tmp_path / "publish_delay_s").write_text("3")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    toks = _tokens(C + 7, 32)
    _, hint = holder.finish("p", toks)
    (ext, _), nones, took = _ask_until_answered(reader, "d", toks, hint, bound_s=1.0)
    assert ext == 0 and nones > 0 and 0.2 <= took < 0.4
    assert reader.sched.stats.publish_hint_timeouts == 1
    # A hint larger than anything published (a forged one) is bounded the same way.
    (ext2, _), _, took2 = _ask_until_answered(reader, "d2", _tokens(C + 7, 33), 10 * C, bound_s=1.0)
    assert ext2 == 0 and took2 < 0.4


def test_a_load_reports_where_its_time_went(pair):
    holder, reader = pair()
    toks = _tokens(2 * C + 3, 34)
    holder.run_request("p", toks)
    reader.sched.stats.phases.take()
    t0 = time.monotonic()
    ext, _, errors = reader.load("d", toks)
    took = time.monotonic() - t0
    assert ext == len(toks) - 1 and not errors
    sched = reader.sched.stats.phases.take()
    worker = reader.worker.stats.take()
    assert set(sched) == {"phase_lookup_s"} and len(sched["phase_lookup_s"]) == 1
    for phase in ("post", "read", "release"):
        assert len(worker[f"phase_{phase}_s"]) == 1, phase
    parts = sched["phase_lookup_s"][0] + sum(worker[f"phase_{p}_s"][0] for p in ("post", "read", "release"))
    assert 0 < parts <= took + 0.005  # phases are disjoint slices of the load, in order
    assert worker["phase_read_s"][0] + worker["phase_release_s"][0] <= worker["transfer_s"][0] + 1e-6


def test_the_hint_announces_only_what_the_cap_let_through(pair):
    # A request the held-blocks cap lets through only in part must not announce the rest: a decode
    # would wait its whole publish_hint_wait_s for chunks that never come.
    holder, _ = pair(max_held_fraction=0.3)  # 9 of 32 blocks
    toks0, toks1 = _tokens(3 * C + 1, 70), _tokens(3 * C + 1, 71)
    _, first = holder.finish("p0", toks0)  # 7 blocks: fits whole
    _, second = holder.finish("p1", toks1)  # 2 more blocks fit: its first chunk only
    assert first == len(toks0)
    assert second == C


def test_each_instance_logs_the_namespace_it_keys_prompts_in(pair, caplog):
    # Instances that should share KV but never hit are told apart by this line (docs/failures.md).
    with caplog.at_level(logging.INFO, logger="pdxfer.vllm.scheduler"):
        holder, reader = pair()
        other_chunk, _ = pair(chunk_tokens=2 * C)
    lines = [r.getMessage() for r in caplog.records if "keys prompts in namespace" in r.getMessage()]
    assert len(lines) == 4, lines
    spaces = [line.split("namespace ", 1)[1].split(":", 1)[0] for line in lines]
    assert spaces[0] == spaces[1] == holder.sched.namespace(None).root().hex()[:16]
    assert spaces[2] == spaces[3] != spaces[0], "another chunk size must log another namespace"
    assert f"chunks of {2 * C} tokens" in lines[2]


def _steps(node: Node, n: int, tokens: int, seconds: float) -> None:
    """``n`` prefill steps as vLLM drives the scheduler: metadata built, the step runs, its output."""
    for i in range(n):
        node.sched.build_connector_meta([f"step{i}"], {f"step{i}": tokens})
        time.sleep(seconds)
        node.sched.step_output(None)


def _measured_load(node: Node, rid: str, toks: list[int]) -> int:
    """A load through the scheduler and worker halves, reported back as vLLM's step output does."""
    ext, _, errors = node.load(rid, toks)
    assert not errors
    node.sched.step_output({rid})
    node.sched.request_finished(rid, None, [], None)
    return ext


def _funnel(node: Node) -> tuple[int, int, int, int]:
    st = node.sched.stats
    return st.hit_exists_tokens, st.hit_visible_tokens, st.lookup_hit_tokens, node.worker.stats.tokens_loaded


def test_the_hit_funnel_says_where_a_requests_held_tokens_stopped(pair, tmp_path, monkeypatch):
    """Exists -> visible -> selected -> loaded, in prompt tokens beyond the local prefix and
    short of the last token: each stage that falls short of the one before names why a request
    did not hit."""
    holder, reader = pair(publish_hint_wait_s=0, load_benefit=True)
    toks = _tokens(2 * C + 3, 90)
    holder.run_request("p0", toks)
    assert _measured_load(reader, "d0", toks) == len(toks) - 1
    n = len(toks) - 1
    assert _funnel(reader) == (n, n, n, n)
    # Announced by its prefill's hint, never published: it exists, the master has none of it.
    gone = _tokens(2 * C + 3, 91)
    assert reader.sched.get_num_new_matched_tokens("d1", gone, len(gone), 0, None, hinted_tokens=len(gone)) == (0, False)
    assert _funnel(reader) == (2 * n, n, n, n)
    # Visible, not selected: the load gate finds it faster to compute (a holder slowed to 0.3 s
    # a read, measured on one load, against a prefill of 400,000 tokens/s here).
    (tmp_path / "read_delay_s").write_text("0.3")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    slow = _tokens(2 * C + 3, 92)
    holder.run_request("p2", slow)
    assert _measured_load(reader, "d2", slow) == n
    assert _funnel(reader) == (3 * n, 2 * n, 2 * n, 2 * n)
    _steps(reader, 4, 4000, 0.01)
    declined = _tokens(2 * C + 3, 93)
    holder.run_request("p3", declined)
    assert reader.sched.get_num_new_matched_tokens("d3", declined, len(declined), 0, None) == (0, False)
    assert _funnel(reader) == (4 * n, 3 * n, 2 * n, 2 * n)
    # Past the local prefix only: 2 chunks already local leave the tail's 3 tokens, 2 of them held
    # here (the last is computed).
    again = _tokens(2 * C + 3, 94)
    holder.run_request("p4", again)
    reader.sched.get_num_new_matched_tokens("d4", again, len(again), 2 * C, None)
    assert _funnel(reader)[:2] == (4 * n + 2, 3 * n + 2)
    reader.sched.reader.drop_lookup("d4")


def test_the_load_gate_computes_a_hit_that_would_load_slower(pair, master, tmp_path, monkeypatch):
    holder, reader = pair(load_benefit=True)
    stats = reader.sched.stats
    # A holder whose reads take 0.3 s (frozen NIC, far away): measured on a real load, which the
    # gate takes on a cold start (nothing measured yet).
    (tmp_path / "read_delay_s").write_text("0.3")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    first = _tokens(2 * C + 3, 70)
    holder.run_request("p0", first)
    assert _measured_load(reader, "d0", first) == len(first) - 1
    assert (stats.load_benefit_loads, stats.load_benefit_recomputes) == (1, 0)
    # A fast prefill here: 4000 tokens per 10 ms step (the rate the gate needs to decide).
    _steps(reader, 4, 4000, 0.01)
    second = _tokens(2 * C + 3, 71)
    holder.run_request("p1", second)
    assert reader.sched.get_num_new_matched_tokens("d1", second, len(second), 0, None) == (0, False)
    assert stats.load_benefit_recomputes == 1 and stats.load_benefit_declined_tokens == len(second) - 1
    from pdxfer.master import MasterClient

    with MasterClient(master.address) as c:
        wait_until(lambda: c.stats()["locks"] == 0, "the declined hit's lock was never released", 5)
    # The same holder against a slow prefill (200 tokens/s here): loading pays, the hit is loaded.
    _steps(reader, 16, 10, 0.05)
    ext, _ = reader.sched.get_num_new_matched_tokens("d2", second, len(second), 0, None)
    assert ext == len(second) - 1 and stats.load_benefit_loads == 2
    reader.sched.reader.drop_lookup("d2")


def test_without_the_gate_every_hit_is_loaded(pair, tmp_path, monkeypatch):
    holder, reader = pair()
    (tmp_path / "read_delay_s").write_text("0.3")
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    first = _tokens(2 * C + 3, 72)
    holder.run_request("p0", first)
    assert _measured_load(reader, "d0", first) == len(first) - 1
    _steps(reader, 4, 4000, 0.01)
    second = _tokens(2 * C + 3, 73)
    holder.run_request("p1", second)
    ext, _ = reader.sched.get_num_new_matched_tokens("d1", second, len(second), 0, None)
    assert ext == len(second) - 1 and reader.sched.stats.load_benefit_recomputes == 0
    reader.sched.reader.drop_lookup("d1")
