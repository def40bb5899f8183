"""Issue 9, hole 2: two processes with one node id. The second registration supersedes the
first; every later call of the first (heartbeat, publish, unpublish, deregister) is refused with
a typed error instead of being applied to (or served from) the second one's registration."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from pdxfer.master import MasterError, NodeInfo, NodeSession
from pdxfer.common.procs import python_env

from .conftest import keys_for, wait_until

_SECOND = """
import sys
from pdxfer.master import MasterClient, NodeInfo
keys = [bytes.fromhex(h) for h in sys.argv[2:]]
with MasterClient(sys.argv[1], timeout_s=2.0) as c:
    c.register_node(NodeInfo("dup", 0, "tcp", b"second", {"v": 2}, "fp"), 30)
    assert c.publish("dup", [(k, [9]) for k in keys]) == len(keys)
"""


def _second_process_registers(address: str, keys: list[bytes]) -> None:
    """Another process registers the same node id (and publishes ``keys``) through its own client."""
    subprocess.run([sys.executable, "-c", _SECOND, address, *(k.hex() for k in keys)], env=python_env(),
                   timeout=30, check=True)


def test_superseded_registration_calls_are_refused(master, masters):
    first = masters.client(master.address)
    reader = masters.client(master.address)
    first.register_node(NodeInfo("dup", 0, "tcp", b"first", {"v": 1}, "fp"), 30)
    mine, theirs, late = keys_for("mine", 2), keys_for("theirs", 2), keys_for("late", 2)
    assert first.publish("dup", [(k, [1]) for k in mine]) == 2
    _second_process_registers(master.address, theirs)

    # A publish by the superseded registration must not be applied (it would be served with
    # the second process's transport metadata, i.e. from the wrong memory).
    err: MasterError | None = None
    try:
        first.publish("dup", [(k, [7]) for k in late])
    except MasterError as exc:
        err = exc
    r = reader.lookup_and_lock(late, reader="d")
    assert r.hit_chunks == 0, "a superseded registration's publish is served with the newer one's metadata"
    assert type(err).__name__ == "RegistrationSuperseded" and "dup" in str(err)
    for call in (lambda: first.heartbeat("dup"), lambda: first.unpublish_if_unlocked("dup", theirs),
                 lambda: first.deregister_node("dup")):
        with pytest.raises(MasterError, match="superseded"):
            call()
    # the second registration is untouched by all that
    r = reader.lookup_and_lock(theirs, reader="d")
    assert r.hit_chunks == 2 and r.nodes["dup"].transport_metadata == b"second"


def test_node_session_stops_when_superseded(master, masters, caplog):
    first = masters.client(master.address)
    superseded = threading.Event()
    s = NodeSession(first, NodeInfo("dup", 0, "tcp", b"first", {"v": 1}, "fp"), lease_ttl_s=0.9,
                    on_superseded=superseded.set)
    s.start()
    try:
        with caplog.at_level(logging.ERROR, logger="pdxfer.master.client.master_client"):
            _second_process_registers(master.address, keys_for("theirs", 1))
            assert superseded.wait(3.0), "NodeSession did not report that it was superseded"
            wait_until(lambda: not s._thread.is_alive(), 3, "the session thread to stop")
        assert s.superseded and not s.registered
        assert any("dup" in r.getMessage() and "superseded" in r.getMessage() for r in caplog.records)
        # it did not re-register over the newer registration
        r = masters.client(master.address).lookup_and_lock(keys_for("theirs", 1), reader="d")
        assert r.nodes["dup"].transport_metadata == b"second"
    finally:
        s.stop()
