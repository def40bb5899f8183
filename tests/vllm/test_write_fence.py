"""The write fence: a holder publishes a finished request only after the device completed the KV
writes of the last step that computed it (pdxfer.vllm.write_fence).

Device writes are played by the CPU stand-in's asynchronous mode: a "KV write" enqueued on the
worker's stream lands ``delay_s`` later, as a forward would on a GPU stream; the synchronous mode
is what a CPU instance of vLLM uses.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from pdxfer.device import CpuStandIn, flat_bytes  # noqa: E402
from pdxfer.device.base import DeviceEvent, DeviceOps, DeviceStream  # noqa: E402
from pdxfer.vllm.metadata import PdxferConnectorMetadata  # noqa: E402
from pdxfer.vllm.write_fence import FenceWriter, WriteFence, WriteFenceError  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.fence_child import one_slow_step  # noqa: E402
from tests.vllm.test_connector_flow import BS, C, NUM_BLOCKS, Node, _same_blocks, _tokens  # noqa: E402
from tests.vllm.test_connector_flow import pair  # noqa: E402,F401  (a fixture)

WRITE_DELAY_S = 0.4  # how long the stand-in's "forward" takes to land its KV writes


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


# ---------------------------------------------------------------------------- two processes

@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory under /dev/shm")
def test_the_fence_crosses_processes_and_waits_for_the_slowest_rank():
    fence = WriteFence.create("engine-two-procs", tp_size=2)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=one_slow_step, args=(fence.name, WRITE_DELAY_S, there), daemon=True)
    child.start()
    try:
        assert here.poll(60), "the worker process never started"
        recorded_at = here.recv()
        # The step's event is recorded, its write not landed: not complete on rank 0.
        assert fence.slots() == [0, 0]
        assert not fence.wait_for(1, 0.05)
        # Rank 0 completes by itself once its write landed (no further step) ...
        wait_until(lambda: fence.slots()[0] == 1, "rank 0 never completed its step", timeout=10, poll=0.002)
        assert time.monotonic() - recorded_at >= WRITE_DELAY_S * 0.9, "completed before the write landed"
        # ... but rank 1 has not: the step is not complete.
        assert fence.completed() == 0 and not fence.wait_for(1, 0.05)
        fence.store(1, 1)  # rank 1 (played here) finished step 1 too
        assert fence.wait_for(1, 0.0)
        assert not fence.wait_for(2, 0.01)  # nothing claims a step not yet run
        here.send("done")
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        fence.close()
    assert not _shm_exists(fence.name), "the scheduler left its fence segment behind"
    with pytest.raises(WriteFenceError):
        WriteFence.attach(fence.name)


def test_a_rank_outside_the_fence_is_refused_and_close_is_idempotent():
    fence = WriteFence.create("engine-small", tp_size=1)
    view = WriteFence.attach(fence.name)  # the same process: the creator's mapping, borrowed
    with pytest.raises(WriteFenceError):
        view.store(1, 5)
    view.store(0, 5)
    assert fence.completed() == 5
    fence.close()
    view.store(0, 6)  # a worker outliving its in-process scheduler at shutdown: ignored
    view.close()
    fence.close()
    assert not _shm_exists(fence.name)


# ---------------------------------------------------------------------------- holder + reader

def _step(node: Node, ops: DeviceOps | None, writer: FenceWriter, scheduled: list[str],
          pattern: torch.Tensor | None) -> PdxferConnectorMetadata:
    """One engine step on ``node``: the scheduler builds it, the worker's "forward" enqueues KV
    writes (``pattern`` over the whole KV storage), then vLLM's wait_for_save."""
    meta = node.sched.build_connector_meta(scheduled)
    if pattern is not None:
        flat = flat_bytes(next(iter(node.kv.values())))
        ops.copy(flat, 0, pattern, 0, flat.numel(), ops.current_stream())
    writer.step_enqueued(meta.write_fence, meta.step_seq)
    return meta


@pytest.fixture
def standin():
    made: list[CpuStandIn] = []

    def make(**kw) -> CpuStandIn:
        made.append(CpuStandIn(**kw))
        return made[-1]

    yield make
    for ops in made:
        ops.close()


def test_the_holder_publishes_only_after_the_step_wrote_its_kv(pair, standin):
    holder, reader = pair(publish_wait_s=0.0)  # nothing waits on the step path
    ops = standin(asynchronous=True, delay_s=WRITE_DELAY_S)
    writer = FenceWriter(0, ops)
    flat = flat_bytes(next(iter(holder.kv.values())))
    g = torch.Generator().manual_seed(9)
    written = torch.randn(flat.numel() // 2, generator=g).to(torch.bfloat16).view(torch.uint8)  # KV is bf16
    toks = _tokens(2 * C + 5, 31)
    blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
    ids = [b.block_id for b in blocks]
    _step(holder, ops, writer, ["p"], written)
    t_finished = time.monotonic()
    holder.sched.request_finished("p", toks, ids, None)  # the scheduler sees it finished at once
    holder.pool.free_blocks(blocks)
    deadline = time.monotonic() + 10
    while holder.sched.stats.published_chunks == 0:
        assert time.monotonic() < deadline, "the publish never landed"
        time.sleep(0.002)
    landed_after = time.monotonic() - t_finished
    # The first moment a reader can find the chunks, their bytes are the step's.
    assert torch.equal(flat, written), "published before the step's KV writes landed"
    assert landed_after >= WRITE_DELAY_S * 0.9
    assert holder.sched.stats.publishes_unfenced == 0
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == 2 * C + 4 and not errors
    assert _same_blocks(holder, ids[:5], reader, r_ids[:5])
    writer.close()


class _NeverDone(DeviceEvent):
    """A step whose device work never completes (a hung kernel)."""

    def query(self) -> bool:
        return False

    def wait(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.05))
        return False


class _HungDevice(CpuStandIn):
    def record_event(self, stream: DeviceStream) -> DeviceEvent:
        return _NeverDone()


def test_a_fence_that_never_completes_drops_the_publish_within_the_bound(pair, caplog):
    bound = 0.3
    holder, reader = pair(publish_wait_s=0.0, publish_fence_wait_s=bound)
    writer = FenceWriter(0, _HungDevice())
    toks = _tokens(2 * C + 5, 32)
    blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
    _step(holder, None, writer, ["p-hung"], None)
    caplog.set_level(logging.WARNING, logger="pdxfer")
    t0 = time.monotonic()
    holder.sched.request_finished("p-hung", toks, [b.block_id for b in blocks], None)
    holder.pool.free_blocks(blocks)
    assert time.monotonic() - t0 < bound / 2, "request_finished waited for the fence on the step path"
    wait_until(lambda: holder.sched.stats.publishes_unfenced == 1, "the unfenced publish was never dropped",
               timeout=bound + 5)
    took = time.monotonic() - t0
    assert bound * 0.9 <= took <= bound + 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "p-hung" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert holder.sched.stats.published_chunks == 0
    assert reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)[0] == 0
    # Held for a publish that never went out: the blocks go back to vLLM, not at retention's end.
    wait_until(lambda: holder.sched.held_chunks == 0, "the dropped publish's blocks stay held", timeout=5)
    holder.sched.drain_frees()
    assert holder.pool.get_num_free_blocks() == NUM_BLOCKS - 1
    writer.close()


def test_on_cpu_the_fence_passes_at_once_without_a_thread(pair, standin):
    holder, reader = pair(publish_wait_s=0.0)
    ops = standin()  # what a CPU vLLM instance uses: work done when enqueued
    writer = FenceWriter(0, ops)
    toks = _tokens(2 * C + 5, 33)
    blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
    meta = _step(holder, ops, writer, ["p"], None)
    assert holder.sched.fence.completed() == meta.step_seq == 1
    t0 = time.monotonic()
    holder.sched.request_finished("p", toks, [b.block_id for b in blocks], None)
    holder.pool.free_blocks(blocks)
    wait_until(lambda: holder.sched.stats.published_chunks == 3, "never published", timeout=5, poll=0.001)
    assert time.monotonic() - t0 < 0.2
    assert writer._thread is None, "a synchronous device needs no fence thread"
    writer.close()


def test_a_request_waits_for_its_own_last_step_not_for_steps_built_after_it(pair, standin):
    """Asynchronous scheduling: step 2 is built (and runs) before step 1's output finishes "p".
    "p" waits only for step 1; "q", scheduled in step 2, waits for step 2; a request no step
    was seen scheduling waits for the newest."""
    holder, _ = pair(publish_wait_s=0.0, publish_fence_wait_s=0.3)
    writer = FenceWriter(0, standin())
    _step(holder, None, writer, ["p", "q"], None)  # completes at once (synchronous stand-in)
    holder.sched.build_connector_meta(["q"])  # step 2: built, never completed here
    for rid, seed in (("p", 34), ("q", 35), ("never-scheduled", 36)):
        toks = _tokens(2 * C + 5, seed)
        blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
        holder.sched.request_finished(rid, toks, [b.block_id for b in blocks], None)
        holder.pool.free_blocks(blocks)
    wait_until(lambda: holder.sched.stats.publishes_unfenced == 2, "q and the unknown one were not dropped",
               timeout=5)
    assert holder.sched.stats.published_chunks == 3  # p's two chunks and tail
    writer.close()


def test_the_connector_reports_each_bound_step_at_wait_for_save(standin):
    """The vLLM hooks: build_connector_meta numbers steps with the requests vLLM scheduled, and
    wait_for_save (after the forward was enqueued) hands the bound step to the fence writer."""
    from pdxfer.vllm.connector import PdxferConnector

    fence = WriteFence.create("engine-hooks", tp_size=1)
    try:
        conn = PdxferConnector.__new__(PdxferConnector)  # the hooks only, without an engine
        conn._fence_writer = FenceWriter(0, standin())
        conn._connector_metadata = PdxferConnectorMetadata(step_seq=4, write_fence=fence.name)
        conn.wait_for_save()
        assert fence.completed() == 4
        conn._connector_metadata = PdxferConnectorMetadata()  # a scheduler without a fence
        conn.wait_for_save()
        assert fence.completed() == 4

        sched = SimpleNamespace(build_connector_meta=lambda scheduled, tokens=None: (
            list(scheduled or ["<none>"]), tokens))
        conn.refusal, conn.scheduler_side = None, sched
        out = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1})
        # The tokens per request too: the load gate measures prefill steps by them.
        assert conn.build_connector_meta(out) == (["a", "b"], {"a": 3, "b": 1})
        assert conn.build_connector_meta(SimpleNamespace()) == (["<none>"], None)
        conn._fence_writer.close()
    finally:
        fence.close()


def test_a_re_registration_does_not_publish_chunks_still_awaiting_their_fence(pair):
    """The master forgot the node while a publish waits for its step: re-publishing what is held
    must leave that publish's chunks to it (their bytes may not be written yet)."""
    holder, reader = pair(publish_wait_s=0.0, publish_fence_wait_s=1.5)
    writer = FenceWriter(0, _HungDevice())
    toks = _tokens(2 * C + 5, 37)
    blocks = holder.pool.get_new_blocks(-(-len(toks) // BS))
    _step(holder, None, writer, ["p"], None)
    holder.sched.request_finished("p", toks, [b.block_id for b in blocks], None)
    holder.pool.free_blocks(blocks)
    holder.sched.holder._republish()  # what the node session runs after a re-registration
    assert reader.sched.get_num_new_matched_tokens("d", toks, len(toks), 0, None)[0] == 0
    wait_until(lambda: holder.sched.stats.publishes_unfenced == 1, "the publish was never dropped", timeout=5)
    writer.close()


def test_the_fence_wait_is_a_positive_number():
    from pdxfer.contracts.connector_config import ConnectorConfigError, parse_extra_config

    assert parse_extra_config({"master": "h:1"}).publish_fence_wait_s == 2.0
    assert parse_extra_config({"master": "h:1", "publish_fence_wait_s": 0.5}).publish_fence_wait_s == 0.5
    for bad in (0, -1, "1", True):
        with pytest.raises(ConnectorConfigError, match="publish_fence_wait_s"):
            parse_extra_config({"master": "h:1", "publish_fence_wait_s": bad})


def test_a_worker_loads_device_operations_only_for_a_fenced_step(monkeypatch, standin):
    """A worker of an instance that holds nothing never touches its device for the fence; a
    holder's worker waits on the device it was given by name."""
    import pdxfer.vllm.write_fence as wf

    asked: list[str] = []
    ops = standin(asynchronous=True, delay_s=0.3)

    def device_ops(device: str) -> DeviceOps:
        asked.append(device)
        return ops

    monkeypatch.setattr(wf, "device_ops_or_none", device_ops)
    writer = FenceWriter(0, device="cuda:3")
    writer.step_enqueued("", 1)  # a scheduler without a fence (a decode-only instance)
    assert asked == []
    fence = WriteFence.create("engine-lazy", tp_size=1)
    try:
        ops.copy(torch.zeros(8, dtype=torch.uint8), 0, torch.ones(8, dtype=torch.uint8), 0, 8, ops.current_stream())
        writer.step_enqueued(fence.name, 1)
        assert asked == ["cuda:3"]
        assert fence.completed() == 0, "completed before the device ran the step"
        assert fence.wait_for(1, 5.0)
    finally:
        writer.close()
        fence.close()


class _BrokenDevice(CpuStandIn):
    def record_event(self, stream: DeviceStream) -> DeviceEvent:
        raise RuntimeError("device lost")


def test_a_failing_device_or_a_foreign_rank_never_fails_the_step_and_never_completes(caplog):
    fence = WriteFence.create("engine-broken", tp_size=1)
    try:
        caplog.set_level(logging.ERROR, logger="pdxfer")
        broken = FenceWriter(0, _BrokenDevice())
        broken.step_enqueued(fence.name, 1)  # must not raise into vLLM's wait_for_save
        broken.step_enqueued(fence.name, 2)
        stranger = FenceWriter(1, CpuStandIn())  # a rank the scheduler has no slot for
        stranger.step_enqueued(fence.name, 1)
        assert fence.completed() == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and "device lost" in errors[0] and "rank 1" in errors[1], errors
        broken.close()
        stranger.close()
    finally:
        fence.close()
