"""A holder and a reader (both connector halves, the TCP transport, a real master) hold the same
fds and threads after many master restarts as after one (issue 19: a soak saw the fds of its
prefill and decode drift by 3-4 over 30 minutes with 5 master restarts).

Each incarnation of the master sees the same traffic: the holder publishes, the reader loads, a
lookup's lock is given back unused, the holder's chunks outlive their retention. After each
restart the process must hold the same fds of every kind (the connections to the master aside: a
client keeps one per caller that used it at the same time) and the same threads; and every
connection it holds to the master must be live, i.e. the master holds its other end: none to a
master that died is kept.
"""

from __future__ import annotations


import pytest

pytest.importorskip("vllm")

from pdxfer.master import start_local_master  # noqa: E402
from pdxfer.common.procs import free_port  # noqa: E402
from tests.fd_census import census_with_master, thread_names, without  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.test_connector_flow import C, Node, _tokens  # noqa: E402

RESTARTS = 6
TO_MASTER = "socket:tcp->master"
FROM_TEST = "socket:tcp<-test"
# Generous bounds: on a busy machine a load past a tight bound fails, and its connections to the
# holder are dropped until the next load, which is a state of the moment, not a leak.
CFG = {"lease_ttl_s": 1.5, "retention_s": 3.0, "lock_ttl_s": 1.0, "load_timeout_s": 30.0,
       "read_timeout_floor_s": 10.0, "connect_timeout_s": 10.0}


def test_holder_and_reader_hold_the_same_fds_and_threads_after_many_master_restarts(tmp_path):
    margs = ["--port", str(free_port()), "--http-port", "-1"]
    m = start_local_master(workdir=tmp_path, extra_args=margs)
    holder = Node("rs-holder", m.address, True, False, seed=7, **CFG)
    reader = Node("rs-reader", m.address, False, True, seed=None, **CFG)
    sessions = [n.sched.holder._session for n in (holder, reader)]
    seq = 0

    def incarnation() -> tuple[dict[str, int], dict[str, int]]:
        nonlocal seq
        for _ in range(3):
            seq += 1
            toks = _tokens(2 * C + 1, seq)
            holder.finish(f"p{seq}", toks)
            ext, ids, errors = reader.load(f"d{seq}", toks)
            assert ext > 0 and not errors, (seq, ext, errors)
            reader.pool.free_blocks([reader.pool.blocks[i] for i in ids])
            # A lookup whose lock goes back unused (the request finished before it was scheduled).
            assert reader.sched.get_num_new_matched_tokens(f"x{seq}", toks, len(toks), 0, None)[0] > 0
            reader.sched.reader.finish_request(f"x{seq}")

        def all_live() -> bool:
            ours, its = census_with_master(m.proc.pid)
            return ours.get(TO_MASTER) == its.get(FROM_TEST)

        # Bounded: the unused lock's release and closes travel while we look.
        wait_until(all_live, "as many connections to the master as it holds from us")
        return census_with_master(m.proc.pid)

    def restart(n: int) -> None:
        nonlocal m
        before = [s.reregistrations for s in sessions]
        m.kill()
        m = start_local_master(workdir=tmp_path, extra_args=margs)
        wait_until(lambda: all(s.reregistrations > b for s, b in zip(sessions, before)),
                   f"both nodes re-registered after restart {n}")

    try:
        # The first incarnation after a restart is the reference: the paths a restart takes
        # (failed calls, re-registration, re-publish) have run once by then.
        restart(1)
        first = incarnation()
        first_threads = thread_names()
        for n in range(2, RESTARTS + 2):
            restart(n)
            ours, its = incarnation()
            assert without(ours, TO_MASTER) == without(first[0], TO_MASTER), \
                f"after restart {n} this process holds {ours}, after the first {first[0]}"
            # A client shared by two threads (a lease keeper and a reaper or releaser) keeps a
            # second connection in an incarnation where their calls overlapped: two such clients.
            assert ours[TO_MASTER] <= first[0][TO_MASTER] + 2, \
                f"after restart {n}: {ours[TO_MASTER]} connections to the master, {first[0][TO_MASTER]} after the first"
            assert without(its, FROM_TEST) == without(first[1], FROM_TEST), \
                f"incarnation {n} of the master holds {its}, the first after a restart {first[1]}"
            assert thread_names() == first_threads, \
                f"threads after restart {n}: {thread_names()}, after the first: {first_threads}"
    finally:
        holder.close()
        reader.close()
        m.kill()
