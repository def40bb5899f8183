"""Issue 9, hole 1: a publish that reaches the master after the holder gave up on it (its call
timed out, or an unpublish on another connection overtook it) must never be applied. Publishes
carry a per-node sequence number; the holder fences "nothing up to seq N" and the master refuses
any publish with seq <= N."""

from __future__ import annotations

import pytest

from pdxfer.master import MasterClient, MasterError, MasterUnavailable

from .conftest import keys_for, node_info, wait_until
from .tcp_proxy import TcpProxy

# The proxy holds a request 1.5 s; this bounds its arrival with room for a loaded box.
LATE_ARRIVAL_S = 15.0


def wait_fenced(client: MasterClient, count: int) -> None:
    """Return once the master has refused ``count`` publishes as fenced: the late publish did
    arrive and was refused (a publish that was merely slow, or never sent, never counts)."""
    wait_until(lambda: client.stats()["publish_fenced"] >= count, LATE_ARRIVAL_S,
               f"the master to refuse {count} late publish(es) as fenced")


@pytest.fixture
def slow_link(master):
    """A real TCP path to the master that delivers requests 1.5 s late."""
    proxy = TcpProxy(master.host, master.port, delay_s=1.5).start()
    try:
        yield proxy
    finally:
        proxy.close()


def test_late_publish_after_unpublish_with_fence_is_refused(master, masters, slow_link):
    assert hasattr(MasterClient, "fence"), "a holder has no way to fence the publishes it gave up on"
    direct = masters.client(master.address, timeout_s=5.0)
    slow = masters.client(slow_link.address, timeout_s=0.5)  # gives up before its request arrives
    reg = direct.register_node(node_info("h"), 30)
    keys = keys_for("late", 3)
    with pytest.raises(MasterUnavailable):
        slow.publish("h", [(k, [i]) for i, k in enumerate(keys)], epoch=reg.epoch, seq=5)
    # The holder gives up on everything it sent up to seq 5, removes the keys, frees the blocks.
    assert direct.unpublish_if_unlocked("h", keys, epoch=reg.epoch, fence_seq=5) == keys
    wait_fenced(direct, 1)
    r = direct.lookup_and_lock(keys, reader="d")
    assert r.hit_chunks == 0, "a publish the holder gave up on was applied after it freed the blocks"
    assert direct.stats()["publish_fenced"] == 1


def test_fence_op_refuses_queued_publishes_up_to_seq(master, masters, slow_link):
    assert hasattr(MasterClient, "fence"), "a holder has no way to fence the publishes it gave up on"
    direct = masters.client(master.address, timeout_s=5.0)
    slow = masters.client(slow_link.address, timeout_s=0.5)
    reg = direct.register_node(node_info("h"), 30)
    keys = keys_for("fence", 2)
    with pytest.raises(MasterUnavailable):
        slow.publish("h", [(keys[0], [1])], epoch=reg.epoch, seq=5)
    assert direct.fence("h", upto_seq=5, epoch=reg.epoch) == 5
    wait_fenced(direct, 1)
    assert direct.lookup_and_lock(keys[:1], reader="d").hit_chunks == 0
    # a publish at or below the fence is refused with a typed error naming both numbers
    with pytest.raises(MasterError, match="seq 4.*fence 5") as info:
        direct.publish("h", [(keys[1], [2])], epoch=reg.epoch, seq=4)
    assert type(info.value).__name__ == "PublishFenced"
    # the fence never goes back, and later publishes are applied
    assert direct.fence("h", upto_seq=3, epoch=reg.epoch) == 5
    assert direct.publish("h", [(keys[1], [2])], epoch=reg.epoch, seq=6) == 1
    # without an explicit seq the client numbers publishes above everything it handed out
    assert direct.publish("h", [(keys[0], [3])]) == 1
    assert direct.last_publish_seq("h") >= 1
