"""Issue 9, hole 10 (master part): the NodeSession heartbeat thread must survive exceptions other
than MasterError (a bug, a surprise from a library): log, keep going, and say so (``healthy``,
``last_error``) instead of dying silently and letting the node's lease lapse."""

from __future__ import annotations

import time

from pdxfer.master import MasterClient, NodeSession

from .conftest import node_info, wait_until


class _FlakyClient(MasterClient):
    """A real client whose first heartbeats fail with a non-MasterError (injected fault)."""

    def __init__(self, *args, failures: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures

    def heartbeat(self, *args, **kwargs) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected: heartbeat blew up")
        return super().heartbeat(*args, **kwargs)


def test_heartbeat_thread_survives_unexpected_exceptions(master, masters):
    c = _FlakyClient(master.address, timeout_s=1.0, failures=3)
    masters.clients.append(c)
    s = NodeSession(c, node_info("flaky"), lease_ttl_s=1.5)
    s.start()
    try:
        wait_until(lambda: c.failures < 3, 5, "the first injected failure")
        time.sleep(1.0)
        assert s._thread is not None and s._thread.is_alive(), "the heartbeat thread died on a RuntimeError"
        assert c.failures == 0 and "injected" in repr(s.last_error)
        wait_until(lambda: s.healthy, 3, "the session to report healthy again")
        time.sleep(2.0)  # longer than the lease: heartbeats kept it
        assert masters.client(master.address).stats()["nodes"] == 1
    finally:
        s.stop()
