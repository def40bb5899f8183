"""Master restarts and clients that come and go leave nothing open behind (issue 19: a soak saw
the fds of its instances and of the master drift by a few over 30 minutes with 5 restarts).

A client process: after many restarts (SIGKILL, then a new master on the same port) it holds the
same fds and threads as after one. Its connections to the master are not a fixed number: a client
keeps one per caller that used it at the same time, so they are bounded by the callers, and every
one of them is live (the master holds its other end): none to a master that died is kept.

The master: once its clients left (closed, killed, dropped without a word) and their leases and
locks ran out, it holds exactly the fds it held before them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from pdxfer.master import MasterClient, NodeSession, start_local_master
from pdxfer.common.procs import free_port
from tests.fd_census import census_with_master, thread_names, without
from tests.master.conftest import keys_for, node_info, wait_until

RESTARTS = 6
TO_MASTER = "socket:tcp->master"
FROM_TEST = "socket:tcp<-test"
REPO = str(Path(__file__).resolve().parents[2])


def test_a_client_holds_the_same_fds_and_threads_after_many_master_restarts(tmp_path):
    margs = ["--port", str(free_port()), "--http-port", "-1"]
    m = start_local_master(workdir=tmp_path, extra_args=margs)
    keys = keys_for("restart", 8)
    hot = MasterClient(m.address, timeout_s=2.0)  # two callers at once, as a holder's hot client
    bg = MasterClient(m.address, timeout_s=2.0)  # the lease keeper's, alone
    callers = 3
    info = node_info("restart-holder")

    def publish(client: MasterClient) -> None:
        client.publish(info.node_id, [(k, [i]) for i, k in enumerate(keys)], retention_s=60)

    # Re-published from the lease keeper's thread, on its own client, as a holder does.
    session = NodeSession(bg, info, lease_ttl_s=1.5, on_reregistered=lambda: publish(bg))
    session.start()
    publish(hot)
    errors: list[BaseException] = []

    def traffic(i: int, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(10)
            for _ in range(5):
                # Locks nobody releases: the master lets them expire.
                r = hot.lookup_and_lock(keys, reader=f"reader-{i}", lock_ttl_s=0.5)
                assert r.hit_chunks == len(keys), r
        except BaseException as exc:
            errors.append(exc)

    def incarnation() -> tuple[dict[str, int], dict[str, int]]:
        """Traffic through the master now running; then what this process and the master hold."""
        barrier = threading.Barrier(2)
        ts = [threading.Thread(target=traffic, args=(i, barrier)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not errors, errors
        # Every connection to the master is live: the master holds as many from us as we hold to
        # it (one kept to a master that died would count on our side only). Bounded: closes
        # travel to the master while we look.
        def all_live() -> bool:
            ours, its = census_with_master(m.proc.pid)
            return ours.get(TO_MASTER) == its.get(FROM_TEST)

        wait_until(all_live, 10, "as many connections to the master as it holds from us")
        ours, its = census_with_master(m.proc.pid)
        assert 2 <= ours[TO_MASTER] <= callers, ours
        return ours, its

    try:
        first = incarnation()
        first_threads = thread_names()
        for n in range(RESTARTS):
            before = session.reregistrations
            m.kill()
            m = start_local_master(workdir=tmp_path, extra_args=margs)
            wait_until(lambda: session.reregistrations > before, 10, f"re-registration after restart {n + 1}")
            ours, its = incarnation()
            assert without(ours, TO_MASTER) == without(first[0], TO_MASTER), \
                f"after restart {n + 1} this process holds {ours}, after the first incarnation {first[0]}"
            assert without(its, FROM_TEST) == without(first[1], FROM_TEST), \
                f"incarnation {n + 2} of the master holds {its}, the first {first[1]}"
            assert thread_names() == first_threads, \
                f"threads after restart {n + 1}: {thread_names()}, after the first incarnation: {first_threads}"
    finally:
        session.stop(deregister=False)
        hot.close()
        bg.close()
        m.kill()


_VANISHING_CLIENT = """
import sys, time
sys.path.insert(0, {repo!r})
from pdxfer.master import MasterClient
from tests.master.conftest import keys_for, node_info
c = MasterClient({address!r})
c.register_node(node_info({node!r}), 1.0)
c.publish({node!r}, [(k, [i]) for i, k in enumerate(keys_for({node!r}, 4))])
c.lookup_and_lock(keys_for({node!r}, 4), reader="vanishing", lock_ttl_s=0.5)
print("ready", flush=True)
time.sleep(60)
"""


def test_the_master_holds_what_it_held_before_once_its_clients_left(master):
    pid = master.proc.pid
    wait_until(lambda: FROM_TEST not in census_with_master(pid)[1], 10, "the start's own ping connection closed")
    base = census_with_master(pid)[1]
    for i in range(3):
        # One client closes, one is dropped without close(), one dies with its connection open;
        # each leaves a node with a short lease and a lock nobody releases.
        for how in ("closed", "dropped", "killed"):
            node = f"{how}-{i}"
            if how == "killed":
                child = subprocess.Popen(
                    [sys.executable, "-c", _VANISHING_CLIENT.format(repo=REPO, address=master.address, node=node)],
                    stdout=subprocess.PIPE, text=True)
                try:
                    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
                finally:
                    child.kill()
                    child.wait(10)
                continue
            c = MasterClient(master.address)
            c.register_node(node_info(node), 1.0)
            keys = keys_for(node, 4)
            c.publish(node, [(k, [j]) for j, k in enumerate(keys)])
            c.lookup_and_lock(keys, reader=node, lock_ttl_s=0.5)
            if how == "closed":
                c.close()
            del c

    def gone() -> bool:
        with MasterClient(master.address) as c:
            s = c.stats()
        return s["nodes"] == 0 and s["locks"] == 0

    wait_until(gone, 10, "every lease and lock expired")
    wait_until(lambda: census_with_master(pid)[1] == base, 10, f"the master's fds back to {base}")
