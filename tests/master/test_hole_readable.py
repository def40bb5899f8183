"""Issue 16, hole 7: a holder the reader cannot read must not hide one it can.

The namespace puts holders of every format and transport (and the reader's own node) under the
same keys. The master picks the holder with the longest run; a reader that cannot read that one
used to load nothing although another holder had the same chunks. A lookup names the
registrations the reader cannot use ("skip") and its transport; the master chooses among the
others only.
"""

from __future__ import annotations


import pytest

from pdxfer.master import NodeInfo
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops

from .conftest import keys_for, node_info, ping_speaking_version


def _nixl_node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, 0, "nixl", b"meta-" + node_id.encode(), {"v": 1, "block_size": 16}, "fp-other")


def _holders(c, prefix: str):
    """'far' (NIXL) holds three chunks, 'near' (TCP) the first two: the greedy pick is 'far'."""
    far = c.register_node(_nixl_node(f"{prefix}-far"), lease_ttl_s=30)
    c.register_node(node_info(f"{prefix}-near"), lease_ttl_s=30)
    keys = keys_for(prefix, 3)
    c.publish(f"{prefix}-far", [(k, [i]) for i, k in enumerate(keys)], retention_s=60.0)
    c.publish(f"{prefix}-near", [(k, [10 + i]) for i, k in enumerate(keys[:2])], retention_s=60.0)
    return far, keys


def _picked(c, keys, **kw) -> list[tuple[str, list[int]]]:
    r = c.lookup_and_lock(keys, reader="d", **kw)
    if r.lock_id is not None:
        assert c.release(r.lock_id, all_parties=True)
    return [(loc.node_id, loc.block_ids) for loc in r.locations]


def test_a_lookup_chooses_only_among_holders_the_reader_can_use(master, masters):
    c = masters.client(master.address)
    far, keys = _holders(c, "skip")
    # Unfiltered: the longest run, as before.
    assert _picked(c, keys) == [("skip-far", [0]), ("skip-far", [1]), ("skip-far", [2])]
    near = [("skip-near", [10]), ("skip-near", [11])]
    # The registration the reader found unusable is skipped: the other holder's chunks come back.
    assert _picked(c, keys, skip={"skip-far": far.epoch}) == near
    # A skip names one registration: a newer one of the node (it may now be readable) is not skipped.
    assert _picked(c, keys, skip={"skip-far": far.epoch + 1})[0][0] == "skip-far"
    # Epoch 0: every registration of the node (the reader's own node, whose epoch it need not know).
    assert _picked(c, keys, skip={"skip-far": 0}) == near
    # Holders that registered another transport than the reader's are never chosen.
    assert _picked(c, keys, transport="tcp") == near
    assert _picked(c, keys, transport="nixl")[0][0] == "skip-far"
    # Nobody usable: a miss, and nothing stays locked.
    r = c.lookup_and_lock(keys, reader="d", skip={"skip-far": 0, "skip-near": 0})
    assert (r.hit_chunks, r.lock_id, r.locations) == (0, None, [])
    assert c.stats()["locks"] == 0


def test_a_lookup_result_names_the_registration_of_each_holder(master, masters):
    c = masters.client(master.address)
    far, keys = _holders(c, "epochs")
    r = c.lookup_and_lock(keys, reader="d")
    assert r.epochs == {"epochs-far": far.epoch}
    c.release(r.lock_id, all_parties=True)


def test_lookup_skip_and_transport_round_trip_and_bad_ones_are_named():
    keys = keys_for("codec", 2)
    req = ops.encode_lookup(P.join_keys(keys), "r", 2.0, {}, skip={"a": 5, "b": 0}, transport="tcp")
    frame = P.encode_frame(req.op, 1, req.doc, req.blob)
    hdr = P.parse_header(frame[: P.HEADER_BYTES])
    body = frame[P.HEADER_BYTES:]
    look = ops.decode_lookup(P.decode_json(body[: hdr.json_len]), memoryview(body)[hdr.json_len:])
    assert (look.skip, look.transport) == ({"a": 5, "b": 0}, "tcp")
    plain = ops.decode_lookup({"n": 0, "reader": "r", "ttl": 1.0}, memoryview(b""))
    assert (plain.skip, plain.transport) == ({}, None)
    for bad, field in [({"skip": ["a"]}, "'skip'"), ({"skip": {"a": -1}}, "'skip'"),
                       ({"skip": {"a": True}}, "'skip'"), ({"skip": {"": 1}}, "'skip'"),
                       ({"skip": {f"n{i}": 1 for i in range(ops.MAX_SKIP + 1)}}, "'skip'"),
                       ({"transport": ""}, "'transport'")]:
        with pytest.raises(P.ProtocolError, match=field) as info:
            ops.decode_lookup({"n": 0, "reader": "r", "ttl": 1.0, **bad}, memoryview(b""))
        assert info.value.code == P.ERR_MALFORMED


def test_a_version_3_client_is_refused_naming_both_versions(master):
    """A reader of protocol 3 would not say what it can read: refused, not served greedily."""
    assert P.PROTOCOL_VERSION == 4
    hdr, doc = ping_speaking_version(master.address, 3)
    assert hdr.op == P.OP_ERROR and doc["err"] == P.ERR_VERSION
    assert "version 3" in doc["msg"] and "speaks 4" in doc["msg"]
