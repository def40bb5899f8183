"""Protocol 3: one node per TP engine, carrying every rank's endpoint; older peers refused clearly."""

from __future__ import annotations

import json

import pytest

from pdxfer.master import NodeInfo, RankEndpoint
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops

from .conftest import keys_for, ping_speaking_version


def tp_node(node_id: str, tp: int = 2) -> NodeInfo:
    more = tuple(RankEndpoint(r, f"meta-{node_id}-r{r}".encode(), {"v": 1, "block_size": 16, "rank": r},
                              f"fp-r{r}") for r in range(1, tp))
    return NodeInfo(node_id, 0, "tcp", f"meta-{node_id}-r0".encode(), {"v": 1, "block_size": 16, "rank": 0},
                    "fp-r0", tp_size=tp, total_kv_heads=8, more_ranks=more)


def test_register_codec_round_trips_every_rank():
    info = tp_node("e", tp=4)
    req = ops.encode_register(info, 10.0)
    # Through JSON, as on the wire.
    parsed = ops.decode_register(json.loads(json.dumps(req.doc)), req.blob)
    assert (parsed.tp_size, parsed.total_kv_heads, parsed.more_ranks) == (4, 8, info.more_ranks)
    epoch, back = ops.decode_node_description("e", json.loads(ops.encode_node_description(parsed, 7)))
    assert epoch == 7 and back == info
    assert [ep.rank for ep in back.endpoints] == [0, 1, 2, 3]
    assert back.endpoint(2).transport_metadata == b"meta-e-r2"
    with pytest.raises(KeyError, match="no rank 4"):
        back.endpoint(4)


@pytest.mark.parametrize("eps, what", [
    ([], "must list the 1 endpoint"),
    ([{"rank": 2, "meta": "", "layout": {}, "fp": "x"}], "ranks 1..1 in order"),
    ([{"rank": 1, "meta": "***", "layout": {}, "fp": "x"}], "base64"),
    ([{"rank": 1, "meta": "", "fp": "x"}], "'layout' object"),
])
def test_register_refuses_inconsistent_endpoints(eps, what):
    req = ops.encode_register(tp_node("e"), 10.0)
    doc = dict(req.doc, eps=eps)
    with pytest.raises(P.ProtocolError, match=what):
        ops.decode_register(doc, req.blob)


def test_master_serves_all_ranks_of_a_tp_node(master, masters):
    c = masters.client(master.address)
    c.register_node(tp_node("tp2"), lease_ttl_s=30)
    keys = keys_for("tp", 2)
    c.publish("tp2", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d")
    assert r.hit_chunks == 2
    node = r.nodes["tp2"]
    assert node.tp_size == 2 and node.total_kv_heads == 8
    assert [(ep.rank, ep.transport_metadata, ep.layout_fingerprint) for ep in node.endpoints] == [
        (0, b"meta-tp2-r0", "fp-r0"), (1, b"meta-tp2-r1", "fp-r1")]
    assert c.release(r.lock_id)


def test_a_version_2_peer_is_refused_naming_both_versions(master):
    hdr, doc = ping_speaking_version(master.address, 2)
    assert hdr.op == P.OP_ERROR and doc["err"] == P.ERR_VERSION
    assert "version 2" in doc["msg"] and f"speaks {P.PROTOCOL_VERSION}" in doc["msg"]


def test_a_lock_for_tp_parties_stays_pinned_until_every_rank_released(master, masters):
    """A TP2 reader's ranks each read under the one lock: the first release must not unpin the
    entries while the other rank may still be reading (the holder could free them)."""
    c = masters.client(master.address)
    c.register_node(tp_node("h2"), lease_ttl_s=30)
    keys = keys_for("parties", 1)
    c.publish("h2", [(keys[0], [5])], retention_s=60.0)
    r = c.lookup_and_lock(keys, reader="d", parties=2)
    assert c.release(r.lock_id) is True  # rank 0 done; rank 1 still reading
    assert c.unpublish_if_unlocked("h2", keys) == []  # still pinned
    assert c.release(r.lock_id) is True  # rank 1 done: the lock held for both
    assert c.unpublish_if_unlocked("h2", keys) == keys
    assert c.release(r.lock_id) is False  # no third party
    # A lock nobody reads under goes back whole.
    c.publish("h2", [(keys[0], [5])], retention_s=60.0)
    r = c.lookup_and_lock(keys, reader="d", parties=4)
    assert c.release(r.lock_id, all_parties=True) is True
    assert c.unpublish_if_unlocked("h2", keys) == keys
