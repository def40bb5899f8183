"""Transport conformance core cases over soft-RoCE (inside the guest): the reader on rxe0, every
holder process on rxe1. The cases are the transport suite's own functions, run with fixtures that
pin each side to its RDMA device."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import ReadState
from tests.transport.conftest import (HOLDER_SIZES, REPO, Holder, MiB, SharedPeers, child_env, read_line,
                                      start_holder, stop)
from tests.transport.conftest import reader_factory  # noqa: F401  (the same fixture, outside its conftest)
from tests.transport.test_conformance import (  # noqa: F401  (collected here, with these fixtures)
    test_4096_scattered_runs_exact,
    test_holder_killed_mid_read_gives_typed_error_in_time,
    test_reads_outside_registered_memory_rejected,
    test_single_run_exact,
)

from .conftest import (HOLDER_DEV, HOLDER_PREFIX, NOT_RDMA, READ_WAIT_S, READER_DEV, START_S, guest_bound,
                       ucx_lane_lines)

KINDS_OVER_RXE = ("nixl",)
# A stall a real fabric shows a live holder (a link flap, a switch port reset, a congested queue).
STALL_S = 2.0


@pytest.fixture(scope="module", params=KINDS_OVER_RXE)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def shared(kind):
    peers = SharedPeers({"prefix_cmd": HOLDER_PREFIX, "timeout": START_S}, connect_timeout=guest_bound(30))
    yield peers
    peers.close()


@pytest.fixture
def freeze_holds_reads():
    """None: rxe answers READs in the kernel, so a frozen holder still serves them; the kill case
    keeps its read in flight by size instead (test_conformance._kill_during_a_long_read)."""
    return None


@pytest.fixture
def holder_factory():
    made: list[Holder] = []

    def make(k: str, sizes: tuple[int, ...] = HOLDER_SIZES) -> Holder:
        h = start_holder(k, sizes=sizes, prefix_cmd=HOLDER_PREFIX, timeout=START_S)
        made.append(h)
        return h

    yield make
    for h in made:
        stop(h.proc)


def test_ucx_carried_the_reads_over_rc_verbs_on_rxe(tmp_path):
    """A holder and a reader process with UCX at info level (to unbuffered stderr, since UCX
    processes die at exit here): RMA must be rc_verbs on the reader's rxe0 and the holder's rxe1,
    and no lane may be TCP or shared memory (a silent fallback would still pass the byte checks)."""
    env = child_env()
    env.update(UCX_LOG_LEVEL="info", UCX_LOG_FILE="stderr")
    logs = {side: tmp_path / f"{side}.log" for side in ("holder", "reader")}
    base = [sys.executable, "-m", "tests.transport.peer_proc"]
    with open(logs["holder"], "w") as herr:
        holder = subprocess.Popen(base + ["hold", "--kind", "nixl", "--sizes", str(MiB)], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=herr, env=dict(env, UCX_NET_DEVICES=f"{HOLDER_DEV}:1"))
    try:
        meta = read_line(holder, "META ", START_S).split()[1]
        with open(logs["reader"], "w") as rerr:
            reader = subprocess.run(base + ["read", "--kind", "nixl", "--meta", meta, "--remote-size", str(MiB),
                                            "--block", "4096", "--batch", "64", "--timeout", str(guest_bound(30))],
                                    cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=rerr, timeout=2 * START_S,
                                    env=dict(env, UCX_NET_DEVICES=f"{READER_DEV}:1"))
    finally:
        stop(holder)
    # The exit status is not checked: UCX processes segfault in a destructor after their work here.
    assert "OK 0" in reader.stdout, f"reader did not read correct bytes: {reader.stdout[-500:]}"
    lines = {side: ucx_lane_lines(p.read_text(errors="replace")) for side, p in logs.items()}
    print(lines)
    assert any("inter-node" in ln for ln in lines["reader"]), \
        f"the reader logged no inter-node endpoint configuration: {logs['reader'].read_text()[-2000:]}"
    for side, dev in (("reader", READER_DEV), ("holder", HOLDER_DEV)):
        assert lines[side], f"the {side} logged no UCX lane configuration"
        for ln in lines[side]:
            assert f"rma(rc_verbs/{dev}:1)" in ln, f"{side}: RMA lane is not rc_verbs on {dev}: {ln}"
            for tl in NOT_RDMA:
                assert f"({tl}/" not in ln, f"{side}: UCX fell back to {tl}: {ln}"


def _netdev_of(rdma_dev: str) -> str:
    """The network device an rxe device sends through."""
    return (Path("/sys/class/infiniband") / rdma_dev / "parent").read_text().strip()


def test_live_holder_survives_a_network_stall(kind, holder_factory, reader_factory):
    """RC retries that bound how long a dead holder holds a read also decide when a live one is
    given up on. Every packet the holder sends is dropped for STALL_S while a read is in flight;
    the read must then finish with the right bytes, not fail as if the holder had died."""
    holder = holder_factory(kind)
    reader = reader_factory(kind)
    peer = reader.t.connect(holder.meta, timeout=guest_bound(30))
    plan = scattered_plan(32 << 10, 64, HOLDER_SIZES[0], reader.dst.nbytes, seed=5)
    assert reader.t.read(peer, plan).wait(READ_WAIT_S) is ReadState.DONE  # connected and warm
    netdev = _netdev_of(HOLDER_DEV)
    drop = ["tc", "qdisc", "add", "dev", netdev, "root", "netem", "loss", "100%"]
    subprocess.run(drop, check=True, timeout=30)
    try:
        reader.dst[:] = 0
        h = reader.t.read(peer, plan)
        time.sleep(STALL_S)
        state = h.poll()
        assert state is not ReadState.DONE, f"the read finished while {netdev} dropped every packet: no stall met it"
        assert state is ReadState.PENDING, \
            f"the read {state.value} in a {STALL_S} s stall: a live holder was given up on as dead"
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", netdev, "root"], check=True, timeout=30)
    assert h.wait(READ_WAIT_S) is ReadState.DONE
    assert mismatches(plan, {0: reader.dst}, dict(enumerate(HOLDER_SIZES)), seed=0) == []
