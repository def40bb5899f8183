"""Issue 9, hole 7: node epochs must be unique across master incarnations, so a reader's node
description cache keyed by (node, epoch) never serves an old holder's metadata after a restart."""

from __future__ import annotations

from pdxfer.master import NodeInfo
from pdxfer.common.procs import free_port

from .conftest import keys_for


def test_restarted_master_does_not_reuse_epochs(masters):
    port = free_port()
    a = masters.start(extra_args=("--port", str(port)))
    holder = masters.client(a.address, timeout_s=1.0)
    reader = masters.client(a.address, timeout_s=1.0)
    keys = keys_for("epochs", 2)
    holder.register_node(NodeInfo("x", 0, "tcp", b"meta-on-A", {"v": 1}, "fp"), 30)
    holder.publish("x", [(k, [1]) for k in keys])
    r = reader.lookup_and_lock(keys, reader="d")
    assert r.nodes["x"].transport_metadata == b"meta-on-A"  # now cached by (x, epoch)
    reader.release(r.lock_id)

    a.kill()
    b = masters.start(extra_args=("--port", str(port)))  # a new incarnation at the same address
    holder.register_node(NodeInfo("x", 0, "tcp", b"meta-on-B", {"v": 2}, "fp"), 30)
    holder.publish("x", [(k, [2]) for k in keys])
    r = reader.lookup_and_lock(keys, reader="d")
    assert b.address == a.address
    assert r.nodes["x"].transport_metadata == b"meta-on-B", "reader kept the previous incarnation's description"
    assert r.nodes["x"].layout == {"v": 2}
