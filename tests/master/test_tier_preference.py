"""A lookup that names the tier its reader measured faster: where several holders hold a chunk,
the master takes one that holds it in that tier, through a real master process (standalone, and
elected through a real etcd). A holder's tier is known from its registered layout (a host tier's
slots are block ids from the device block count on)."""

from __future__ import annotations

import dataclasses

import pytest

from pdxfer.master import MasterClient
from pdxfer.master.wire import protocol as P
from pdxfer.master.server.index import ChunkIndex
from pdxfer.master.wire.protocol import pack_u32
from pdxfer.kv.tiers import DEVICE_TIER, HOST_LAYOUT_KEY, HOST_TIER, host_block_base, tier_of

from .conftest import keys_for, node_info
from .test_peek_nodes import _raw_frame, address  # noqa: F401  (the same fixture)
from .test_protocol_fuzz import _error_for

DEVICE_BLOCKS = 100  # each test holder's device block count: host slot s is block 100 + s


def holder(node_id: str, host_tier: bool):
    layout = {"v": 1, "block_size": 16, "num_blocks": DEVICE_BLOCKS}
    if host_tier:
        layout[HOST_LAYOUT_KEY] = {"num_blocks": 8}
    return dataclasses.replace(node_info(node_id), layout=layout)


def chosen(c: MasterClient, keys: list[bytes], tier: str | None) -> list[tuple[str, int]]:
    """(holder, first block id) per chunk of a lookup with ``tier`` preferred, its lock released."""
    r = c.lookup_and_lock(keys, reader="tier-check", prefer_tier=tier)
    if r.lock_id:
        assert c.release(r.lock_id)
    return [(loc.node_id, loc.block_ids[0]) for loc in r.locations]


def test_tier_of_a_location_from_the_registered_layout():
    assert host_block_base({"num_blocks": 100}) is None  # no host tier
    assert host_block_base({"num_blocks": 100, HOST_LAYOUT_KEY: {}}) == 100
    assert host_block_base({"num_blocks": "100", HOST_LAYOUT_KEY: {}}) is None  # not a block count
    assert tier_of([99], 100) == DEVICE_TIER and tier_of([100], 100) == HOST_TIER
    assert tier_of([5, 104], 100) == HOST_TIER and tier_of([104], None) == DEVICE_TIER


def test_lookup_takes_the_preferred_tier_where_several_holders_hold_a_chunk(address, masters):
    c = masters.client(address, timeout_s=5.0)
    keys = keys_for("tier", 6)
    c.register_node(holder("gpu", host_tier=False), 30)
    c.register_node(holder("mixed", host_tier=True), 30)
    # "gpu" holds chunks 0-5 in its KV cache; "mixed" held 0-5 too and moved 0-3 to its host tier.
    c.publish("gpu", [(k, [i]) for i, k in enumerate(keys)])
    c.publish("mixed", [(k, [DEVICE_BLOCKS + i]) for i, k in enumerate(keys[:4])])
    c.publish("mixed", [(k, [10 + i]) for i, k in enumerate(keys[4:], 4)])
    host = chosen(c, keys, HOST_TIER)
    assert host[:4] == [("mixed", 100), ("mixed", 101), ("mixed", 102), ("mixed", 103)], host
    assert len(host) == 6  # chunks 4-5 are on no host tier: from either holder, as before
    device = chosen(c, keys, DEVICE_TIER)
    assert device == [("gpu", i) for i in range(6)], device  # never "mixed"'s host copies
    # No preference: the tied holders still take turns, as before.
    firsts = {chosen(c, keys, None)[0][0] for _ in range(4)}
    assert firsts == {"gpu", "mixed"}


def test_a_preferred_tier_nobody_holds_changes_nothing_and_the_hit_is_as_long(address, masters):
    c = masters.client(address, timeout_s=5.0)
    keys = keys_for("tier-none", 4)
    c.register_node(holder("a", host_tier=False), 30)
    c.register_node(holder("b", host_tier=True), 30)
    c.publish("a", [(k, [i]) for i, k in enumerate(keys[:3])])
    c.publish("b", [(k, [i]) for i, k in enumerate(keys[:2])])  # b's host tier is empty
    got = chosen(c, keys, HOST_TIER)
    assert got == [("a", 0), ("a", 1), ("a", 2)]  # nobody holds them on a host: the longest run


def test_a_bad_tier_is_refused_by_name(masters):
    m = masters.start()
    keys = keys_for("tier-bad", 2)
    doc = {"n": 2, "reader": "r", "ttl": 5.0, "have": {}, "tier": "ssd"}
    err = _error_for(m.address, _raw_frame(P.OP_LOOKUP, doc, b"".join(keys)))
    assert err["err"] == P.ERR_MALFORMED and "'tier'" in err["msg"] and "ssd" in err["msg"], err


def test_preference_leaves_single_holder_runs_and_rotation_alone():
    """In the index itself: a preference where only one holder is live changes nothing, and one
    naming the tier every candidate is in keeps the rotation among them."""
    ix = ChunkIndex()
    keys = keys_for("tier-ix", 3)
    for nid in ("x", "y"):
        ix.register(nid, "{}", 10.0, now=0.0, host_base=50)
        ix.publish(nid, [(k, pack_u32([i])) for i, k in enumerate(keys)], None, now=0.0)
    got = [ix.lookup_and_lock(keys, "r", 5.0, now=1.0 + t, prefer_tier=DEVICE_TIER).runs for t in range(2)]
    assert got == [[("x", 3)], [("y", 3)]]
    ix.deregister("y")
    assert ix.lookup_and_lock(keys, "r", 5.0, now=4.0, prefer_tier=HOST_TIER).runs == [("x", 3)]


@pytest.mark.parametrize("tier", [DEVICE_TIER, HOST_TIER, None])
def test_the_client_sends_the_tier_only_when_asked(tier):
    from pdxfer.master.wire import ops as ops

    req = ops.encode_lookup(b"".join(keys_for("t", 1)), "r", 5.0, {}, prefer_tier=tier)
    assert req.doc.get("tier") == tier and ("tier" in req.doc) == (tier is not None)
    assert ops.decode_lookup(req.doc, req.blob).prefer_tier == tier


def test_peek_says_how_far_each_holders_kv_cache_holds_a_prefix(address, masters):
    """A router sends work to the instance whose own cache holds the prefix: a prefix that a
    holder's host tier holds is held for other readers, not a hit in that holder's KV cache."""
    c = masters.client(address, timeout_s=5.0)
    keys = keys_for("tier-peek", 4)
    c.register_node(holder("gpu", host_tier=False), 30)
    c.register_node(holder("mixed", host_tier=True), 30)
    c.register_node(holder("moved", host_tier=True), 30)
    c.register_node(holder("kept", host_tier=True), 30)
    c.publish("gpu", [(k, [i]) for i, k in enumerate(keys)])
    c.publish("mixed", [(k, [i if i < 2 else DEVICE_BLOCKS + i]) for i, k in enumerate(keys)])
    c.publish("moved", [(k, [DEVICE_BLOCKS + i]) for i, k in enumerate(keys[:3])])
    c.publish("kept", [(k, [i]) for i, k in enumerate(keys[:3])])  # a host tier, nothing moved yet
    p = c.peek(keys)
    assert p.hit == 4 and p.prefix_by_node == {"gpu": 4, "mixed": 4, "moved": 3, "kept": 3}
    assert p.device_prefix_by_node == {"gpu": 4, "mixed": 2, "moved": 0, "kept": 3}


@pytest.mark.parametrize("device", [{"ghost": 0}, {"a": 3}, {"a": -1}, {"a": "1"}, ["a"]])
def test_a_peek_reply_with_a_bad_device_map_is_refused_by_name(device):
    """A reply naming a node outside 'prefix', or not fewer chunks than its prefix, is malformed."""
    from pdxfer.master.wire import ops as ops

    doc = {"hit": 3, "prefix": {"a": 3}, "device": device, "nodes": {"a": {"epoch": 1}}}
    with pytest.raises(P.ProtocolError, match="'device'"):
        ops.decode_peek_reply(doc, b"", 3)
    ok = dict(doc, device={"a": 1})
    assert ops.decode_peek_reply(ok, b"", 3).device_prefix_by_node == {"a": 1}
    assert ops.decode_peek_reply({k: v for k, v in doc.items() if k != "device"}, b"", 3
                                 ).device_prefix_by_node == {"a": 3}
