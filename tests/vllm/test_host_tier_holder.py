"""The scheduler half of the host tier against a real master and vLLM's real BlockPool:
write-through offload jobs in the step's metadata, the fenced move of a chunk's master entry to
its host copy when retention ends (never while a reader's lock pins the device entry), failed
copies falling back to the unpublish, and the host LRU evicting (unpublishing) before reuse."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from pdxfer.kv.layout import describe_kv_caches  # noqa: E402
from pdxfer.master import MasterClient  # noqa: E402
from pdxfer.contracts.connector_config import parse_extra_config  # noqa: E402
from pdxfer.vllm.metadata import PdxferWorkerMeta  # noqa: E402
from pdxfer.vllm.scheduler.scheduler_side import SchedulerSide  # noqa: E402
from pdxfer.vllm.worker.worker_side import WorkerSide  # noqa: E402
from tests.vllm.conftest import finish_request, wait_until  # noqa: E402
from tests.vllm.test_connector_flow import BS, C, NUM_BLOCKS, _kv, _tokens  # noqa: E402


class HostHolder:
    """A holder's scheduler half whose worker reported ``host_blocks`` host slots."""

    def __init__(self, name: str, master_addr: str, host_blocks: int, **extra):
        self.kv = _kv(1)
        layout = describe_kv_caches(self.kv, block_size=BS)
        self.cfg = parse_extra_config({"master": master_addr, "transport": "tcp", "publish_wait_s": 2.0,
                                       "host_tier_mib": 1, **extra})
        self.pool = BlockPool(NUM_BLOCKS, True, BS)
        self.sched = SchedulerSide(self.cfg, engine_id=name, model_id="tiny", layout_fingerprint=layout.fingerprint(),
                                   content_fingerprint=layout.content_fingerprint(layout.kv_heads),
                                   total_kv_heads=layout.kv_heads, block_size=BS, producer=True, consumer=False)
        self.sched.bind_block_pool(self.pool)
        self.worker = WorkerSide(self.cfg, node_id=f"{name}-r0", rank=0, expected_fingerprint=layout.fingerprint(),
                                 block_size=BS)
        hs = self.worker.register_kv_caches(self.kv)
        hs.host_blocks = host_blocks  # what the worker half reports once it has a host pool
        self.sched.on_handshake([hs])
        self.client = MasterClient(master_addr, timeout_s=2.0)

    def finish(self, rid: str, toks: list[int]) -> list[int]:
        return finish_request(self.sched, self.pool, BS, rid, toks)[0]

    def keys(self, toks: list[int]) -> list[bytes]:
        h = self.sched._new_hasher(None)
        keys = h.update(list(toks))
        tail = h.tail(list(toks))
        return keys + ([tail] if tail is not None else [])

    def master_blocks(self, toks: list[int]) -> list[list[int]]:
        """What the master serves for the prompt now (the lookup's lock is given back at once)."""
        r = self.client.lookup_and_lock(self.keys(toks), "probe")
        if r.lock_id:
            self.client.release(r.lock_id, all_parties=True)
        return [list(loc.block_ids) for loc in r.locations]

    def step_jobs(self):
        return self.sched.build_connector_meta().offloads

    def answer(self, done=(), failed=None) -> None:
        self.sched.worker_output(PdxferWorkerMeta({j.job_id: 1 for j in done}, dict(failed or {})))

    def close(self) -> None:
        self.client.close()
        self.sched.close()
        self.worker.close()


@pytest.fixture
def host_holder(master):
    made: list[HostHolder] = []

    def make(host_blocks: int = 8, **extra) -> HostHolder:
        h = HostHolder(f"hh{len(made)}", master.address, host_blocks, **extra)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _host_ids(jobs) -> list[list[int]]:
    return [[NUM_BLOCKS + s for s in j.host_slots] for j in jobs]


def test_a_finished_chunk_is_copied_then_moves_to_host_when_retention_ends(host_holder):
    h = host_holder(retention_s=0.5)
    toks = _tokens(C + 3, 7)
    free0 = h.pool.get_num_free_blocks()
    ids = h.finish("p", toks)
    jobs = h.step_jobs()
    # One job per new chunk (the full chunk and the tail), device blocks -> fresh slots, sent once.
    assert [list(j.device_blocks) for j in jobs] == [ids[0:2], ids[2:3]]
    assert h.step_jobs() == [] and h.sched.has_pending_push_work()
    assert h.master_blocks(toks) == [ids[0:2], ids[2:3]]
    h.answer(done=jobs)
    assert not h.sched.has_pending_push_work() and h.sched.stats.offloads_completed == 2
    assert len(h.sched.stats.offload_s) == 2 and min(h.sched.stats.offload_s) >= 0  # timed for /metrics
    wait_until(lambda: h.sched.holder.host_chunks == 2, "the chunks never moved to the host tier", 5)
    assert h.master_blocks(toks) == _host_ids(jobs)
    wait_until(lambda: not h.sched.held_chunks, "device blocks still held after the move", 5)
    h.sched.drain_frees()
    assert h.pool.get_num_free_blocks() == free0
    assert h.sched.stats.host_moves == 2 and h.sched.gauges()["host_chunks"] == 2
    # Finished again: served from the host copy, nothing held on the device, nothing copied.
    ids2 = h.finish("p2", toks)
    assert h.step_jobs() == [] and not h.sched.held_chunks and h.master_blocks(toks) == _host_ids(jobs)
    assert ids2


def test_a_readers_lock_on_the_device_entry_makes_the_move_wait(host_holder):
    h = host_holder(retention_s=0.5, lock_ttl_s=5.0)
    toks = _tokens(C + 3, 8)
    free0 = h.pool.get_num_free_blocks()
    ids = h.finish("p", toks)
    jobs = h.step_jobs()
    h.answer(done=jobs)
    refused0 = h.client.stats()["publish_refused"]
    lock = h.client.lookup_and_lock(h.keys(toks), "reader", lock_ttl_s=5.0)
    assert lock.hit_chunks == 2 and [list(x.block_ids) for x in lock.locations] == [ids[0:2], ids[2:3]]
    # Retention over, the holder tries the move: the master refuses re-pointing both pinned keys.
    wait_until(lambda: h.client.stats()["publish_refused"] >= refused0 + 2,
               "the master never refused the move of the pinned chunks", 5)
    h.sched.drain_frees()
    assert h.sched.held_chunks == 2 and h.sched.holder.host_chunks == 0
    assert h.pool.get_num_free_blocks() == free0 - 3  # device blocks still held under the lock
    assert h.sched.stats.host_moves == 0
    assert h.client.release(lock.lock_id, all_parties=True)
    wait_until(lambda: h.sched.holder.host_chunks == 2, "the move never happened after the lock went", 5)
    assert h.master_blocks(toks) == _host_ids(jobs)
    wait_until(lambda: not h.sched.held_chunks, "device blocks still held after the move", 5)
    h.sched.drain_frees()
    assert h.pool.get_num_free_blocks() == free0


def test_a_failed_copy_leaves_the_chunk_to_be_unpublished_as_before(host_holder):
    h = host_holder(retention_s=0.5)
    toks = _tokens(C + 3, 9)
    free0 = h.pool.get_num_free_blocks()
    h.finish("p", toks)
    jobs = h.step_jobs()
    h.answer(done=jobs[1:], failed={jobs[0].job_id: "cudaMemcpyAsync failed"})
    assert h.sched.stats.offloads_failed == 1 and h.sched.gauges()["host_slots_used"] == len(jobs[1].host_slots)
    wait_until(lambda: not h.sched.held_chunks, "chunks never freed", 5)
    # The full chunk (no copy) was unpublished; the tail moved. A lookup stops at the first miss.
    assert h.master_blocks(toks) == []
    assert h.sched.holder.host_chunks == 1 and h.sched.stats.host_moves == 1
    h.sched.drain_frees()
    assert h.pool.get_num_free_blocks() == free0


def test_an_unanswered_copy_is_dropped_after_the_bound(host_holder, monkeypatch):
    import pdxfer.vllm.scheduler.holder_host_tier as host_tier_mod

    h = host_holder(retention_s=30.0)
    h.sched.holder.host_tier.jobs.answer_bound_s = 0.2
    h.finish("p", _tokens(C + 3, 10))
    h.step_jobs()
    assert h.sched.has_pending_push_work()
    time.sleep(0.3)
    h.answer()  # a step without any answer: the bound passed
    assert not h.sched.has_pending_push_work() and h.sched.stats.offloads_failed == 2
    assert h.sched.gauges()["host_slots_used"] == 0
    assert host_tier_mod.OFFLOAD_ANSWER_BOUND_S > 1  # the default is far above a copy's time


def test_a_full_host_pool_evicts_the_oldest_host_chunk_before_reusing_its_slots(host_holder):
    h = host_holder(host_blocks=3, retention_s=0.3, lock_ttl_s=5.0)
    a = _tokens(C + 3, 11)  # 3 blocks: fills the host pool
    h.finish("a", a)
    jobs_a = h.step_jobs()
    h.answer(done=jobs_a)
    wait_until(lambda: h.sched.holder.host_chunks == 2, "a never moved to the host tier", 5)
    slots_a = {s for j in jobs_a for s in j.host_slots}
    # A reader pins a's host entries: eviction is refused, so nothing may take their slots.
    refused0 = h.client.stats()["unpublish_refused"]
    lock = h.client.lookup_and_lock(h.keys(a), "reader", lock_ttl_s=5.0)
    assert [list(x.block_ids) for x in lock.locations] == _host_ids(jobs_a)
    h.finish("b", _tokens(C + 3, 12))
    assert h.step_jobs() == []  # no free slot
    wait_until(lambda: h.client.stats()["unpublish_refused"] >= refused0 + 2,
               "the master never refused evicting the pinned host chunks", 5)
    h.finish("c", _tokens(C + 3, 13))
    assert h.step_jobs() == [] and h.sched.stats.host_evictions == 0 and h.sched.holder.host_chunks == 2
    assert h.client.release(lock.lock_id, all_parties=True)
    h.finish("d", _tokens(C + 3, 14))  # no room again: this time the eviction goes through
    wait_until(lambda: h.sched.stats.host_evictions == 2, "the host LRU never evicted a", 5)
    assert h.master_blocks(a) == []  # unpublished at the master before its slots are reused
    e = _tokens(C + 3, 15)
    h.finish("e", e)
    jobs_e = h.step_jobs()
    assert {s for j in jobs_e for s in j.host_slots} == slots_a


def test_cap_pressure_moves_copied_chunks_to_host_instead_of_dropping_them(host_holder):
    h = host_holder(host_blocks=32, max_held_fraction=0.25, retention_s=60.0)  # 8 of 32 blocks held at most
    p0 = _tokens(3 * C + 1, 20)  # 7 blocks: 3 chunks + the tail
    h.finish("p0", p0)
    jobs0 = h.step_jobs()
    h.answer(done=jobs0)
    h.finish("p1", _tokens(3 * C + 1, 21))  # does not fit under the cap with p0: room is made
    wait_until(lambda: h.sched.stats.host_moves, "no chunk moved under cap pressure", 5)
    assert h.sched.stats.pressure_reclaims >= h.sched.stats.host_moves
    # p0's leading chunk left the device for its host copy, still served (not unpublished).
    assert h.master_blocks(p0)[0] == _host_ids(jobs0)[0]
    assert h.sched.held_blocks <= 8


def test_host_chunks_are_published_again_after_re_registration(host_holder):
    h = host_holder(retention_s=0.3)
    toks = _tokens(C + 3, 30)
    h.finish("p", toks)
    jobs = h.step_jobs()
    h.answer(done=jobs)
    wait_until(lambda: h.sched.holder.host_chunks == 2, "the chunks never moved to the host tier", 5)
    # The master forgets them behind the holder's back (as after a restart) ...
    assert len(h.client.unpublish_if_unlocked(h.sched.node_id, h.keys(toks))) == 2
    assert h.master_blocks(toks) == []
    h.sched.holder._republish()  # what the node session runs after a re-registration
    wait_until(lambda: h.master_blocks(toks) == _host_ids(jobs), "host chunks never re-published", 5)


def test_the_connector_hands_vllms_step_output_to_the_host_tier(host_holder):
    from vllm.v1.outputs import KVConnectorOutput

    from pdxfer.vllm.connector import PdxferConnector

    h = host_holder(retention_s=30.0)
    # The vLLM-facing adapter around this scheduler half (its constructor needs a whole VllmConfig).
    conn = PdxferConnector.__new__(PdxferConnector)
    conn.scheduler_side = h.sched
    assert not conn.has_pending_push_work()
    h.finish("p", _tokens(C + 3, 40))
    assert conn.has_pending_push_work()  # queued: vLLM keeps stepping for it
    jobs = h.step_jobs()
    conn.update_connector_output(KVConnectorOutput())  # a step without worker metadata
    assert conn.has_pending_push_work()
    conn.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=PdxferWorkerMeta({j.job_id: 1 for j in jobs}, {})))
    assert not conn.has_pending_push_work() and h.sched.stats.offloads_completed == 2
