"""The index's fencing rules (issue 9, holes 1, 2, 7), driven with explicit timestamps."""

from __future__ import annotations

import pytest

from pdxfer.master.server.index import (
    ChunkIndex,
    FencedError,
    SupersededError,
    UnknownNodeError,
)
from pdxfer.master.wire.protocol import pack_u32

from .conftest import keys_for


def test_epochs_differ_across_index_incarnations_and_registrations():
    a, b = ChunkIndex(), ChunkIndex()
    ea1, ea2 = a.register("x", "{}", 10, 0.0), a.register("x", "{}", 10, 0.0)
    eb = b.register("x", "{}", 10, 0.0)
    assert ea2 > ea1 and eb not in (ea1, ea2)
    assert max(ea1, ea2, eb) < 1 << 62  # the wire's bound


def test_calls_naming_an_older_registration_change_nothing():
    ix = ChunkIndex()
    k = keys_for("sup", 2)
    old = ix.register("x", "{}", 10, 0.0)
    new = ix.register("x", "{}", 10, 0.0)
    ix.publish("x", [(k[0], pack_u32([1]))], None, 0.0, epoch=new, seq=1)
    for call in (lambda: ix.publish("x", [(k[1], pack_u32([2]))], None, 1.0, epoch=old, seq=2),
                 lambda: ix.unpublish_if_unlocked("x", k, 1.0, epoch=old),
                 lambda: ix.heartbeat("x", 1.0, epoch=old),
                 lambda: ix.fence("x", 9, 1.0, epoch=old),
                 lambda: ix.deregister("x", epoch=old)):
        with pytest.raises(SupersededError, match="superseded"):
            call()
    assert ix.lookup_and_lock(k, "r", 5.0, 1.0).hit == 1 and ix.nodes["x"].epoch == new
    assert ix.deregister("x", epoch=new) is True
    with pytest.raises(UnknownNodeError):
        ix.publish("x", [(k[1], pack_u32([2]))], None, 1.0, epoch=new, seq=3)


def test_fence_refuses_publishes_up_to_it_and_never_goes_back():
    ix = ChunkIndex()
    k = keys_for("fence", 3)
    e = ix.register("h", "{}", 10, 0.0)
    assert ix.publish("h", [(k[0], pack_u32([1]))], None, 0.0, epoch=e, seq=3) == 1
    # unpublish with a fence: removes k0 and refuses any publish with seq <= 5 from now on
    assert ix.unpublish_if_unlocked("h", [k[0]], 1.0, epoch=e, fence=5) == [0]
    with pytest.raises(FencedError, match="seq 5 .*fence 5"):
        ix.publish("h", [(k[0], pack_u32([1]))], None, 1.0, epoch=e, seq=5)
    assert ix.fence("h", 2, 1.0, epoch=e) == 5
    assert ix.publish("h", [(k[1], pack_u32([2]))], None, 1.0, epoch=e, seq=6) == 1
    assert ix.lookup_and_lock(k, "r", 5.0, 1.0).hit == 0  # k0 gone, k1 alone is not a prefix
    assert ix.lookup_and_lock(k[1:], "r", 5.0, 1.0).hit == 1
    assert ix.counters.publish_fenced == 1
    # a new registration starts with no fence
    e2 = ix.register("h", "{}", 10, 2.0)
    assert ix.publish("h", [(k[2], pack_u32([3]))], None, 2.0, epoch=e2, seq=1) == 1
