"""The read-only ops a router uses, through a real master process (standalone, and elected through a
real etcd): ``peek`` (what the fleet holds of a prompt and where, nothing locked) and ``nodes``
(the live registrations, with what a router needs to reach each engine)."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from pdxfer.master import MasterClient, MasterProtocolError, NodeInfo, PeekResult
from pdxfer.master.wire import protocol as P

from .conftest import keys_for, node_info, wait_until
from .test_etcd_ha import PREFIX, etcd_keys, ha_args, role
from .test_protocol_fuzz import _error_for


def serving_node(node_id: str, transport: str = "tcp", **fields) -> NodeInfo:
    return dataclasses.replace(node_info(node_id), transport=transport, **fields)


@pytest.fixture(params=["standalone", "etcd"])
def address(request, masters) -> str:
    """A master to talk to: one process, or a leader elected through a real etcd (clients follow
    it through the etcd:// address)."""
    if request.param == "standalone":
        return masters.start().address
    etcd = request.getfixturevalue("etcd")
    m = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(m.address), 10, "the replica to lead")
    return f"etcd://{etcd.endpoint}{PREFIX}"


def peek_then_lookup(c: MasterClient, keys: list[bytes], **filters) -> tuple[PeekResult, int, list[str]]:
    """The peek, and what a lookup with the same filters then hit (its lock released at once)."""
    p = c.peek(keys, **filters)
    r = c.lookup_and_lock(keys, reader="router-check", **filters)
    if r.lock_id:
        assert c.release(r.lock_id)
    return p, r.hit_chunks, [loc.node_id for loc in r.locations]


def test_peek_agrees_with_lookup_across_holders_leases_retention_and_filters(address, masters):
    c = masters.client(address, timeout_s=5.0)
    keys = keys_for("peek", 10)
    c.register_node(serving_node("a"), 30)
    c.register_node(serving_node("b"), 30)
    c.register_node(serving_node("c"), 30)
    c.register_node(serving_node("rdma", transport="nixl"), 30)
    c.register_node(serving_node("brief"), 0.5)  # its lease runs out below: never heartbeated
    c.publish("a", [(k, [1]) for k in keys[:4]])
    c.publish("b", [(k, [2]) for k in keys[:6]])
    c.publish("c", [(k, [3]) for k in keys[2:8]])
    c.publish("rdma", [(k, [4]) for k in keys[:9]])
    c.publish("brief", [(k, [5]) for k in keys])
    c.register_node(serving_node("retained"), 30)
    c.publish("retained", [(k, [6]) for k in keys], retention_s=0.5)
    c.register_node(serving_node("mixed"), 30)  # its run ends where its retained entries start
    c.publish("mixed", [(k, [7]) for k in keys[:3]])
    c.publish("mixed", [(k, [7]) for k in keys[3:7]], retention_s=0.5)

    p, hit, _ = peek_then_lookup(c, keys)
    assert p.hit == hit == 10
    assert p.prefix_by_node == {"a": 4, "b": 6, "rdma": 9, "brief": 10, "retained": 10, "mixed": 7}
    assert set(p.nodes) == set(p.prefix_by_node)

    time.sleep(0.7)  # "brief"'s lease and "retained"'s retention are over
    p, hit, _ = peek_then_lookup(c, keys)
    assert p.hit == hit == 9  # nobody live holds chunk 9 any more
    assert p.prefix_by_node == {"a": 4, "b": 6, "rdma": 9, "mixed": 3}

    p, hit, used = peek_then_lookup(c, keys, transport="tcp")
    assert p.hit == hit == 8  # b (0..5) then c (6, 7); the nixl holder is no candidate
    assert p.prefix_by_node == {"a": 4, "b": 6, "mixed": 3} and set(used) <= {"a", "b", "c"}

    p, hit, used = peek_then_lookup(c, keys, skip={"b": 0, "rdma": 0, "mixed": 0})
    assert p.hit == hit == 8  # a holds 0..3, then c 4..7
    assert p.prefix_by_node == {"a": 4} and used == ["a"] * 4 + ["c"] * 4


def test_peek_matches_lookup_on_random_fleets(masters):
    """Random holders, holes, retentions and filters: the peek's hit is the lookup's, and each
    node's prefix is what it alone holds from key 0 (checked against the published pattern)."""
    m = masters.start()
    c = masters.client(m.address)
    rng = random.Random(18)
    nodes = [f"n{i}" for i in range(4)]
    for trial in range(12):
        keys = keys_for(f"rand-{trial}", 12)
        held: dict[str, set[int]] = {}
        for nid in nodes:
            c.register_node(serving_node(nid, transport=rng.choice(["tcp", "nixl"])), 30)  # drops old entries
            start = rng.choice([0, 0, 1, 3])
            chunks = {i for i in range(start, rng.randint(start, 12)) if rng.random() > 0.1}
            held[nid] = chunks
            if chunks:
                c.publish(nid, [(keys[i], [i]) for i in sorted(chunks)])
        transports = {n.node_id: n.transport for n in c.nodes()}
        skip = {rng.choice(nodes): 0} if rng.random() < 0.5 else None
        transport = rng.choice([None, "tcp"])

        def usable(nid: str) -> bool:
            return (not skip or nid not in skip) and (transport is None or transports[nid] == transport)

        want_prefix = {}
        for nid in filter(usable, nodes):
            run = 0
            while run in held[nid]:
                run += 1
            if run:
                want_prefix[nid] = run
        want_hit = 0
        while any(want_hit in held[nid] for nid in nodes if usable(nid)):
            want_hit += 1
        p, hit, _ = peek_then_lookup(c, keys, skip=skip, transport=transport)
        assert (p.hit, hit) == (want_hit, want_hit), (trial, held, skip, transport)
        assert p.prefix_by_node == want_prefix, (trial, held, skip, transport)


def test_peek_pins_nothing(address, masters):
    c = masters.client(address, timeout_s=5.0)
    keys = keys_for("nopin", 5)
    c.register_node(serving_node("h"), 30)
    c.publish("h", [(k, [i]) for i, k in enumerate(keys)])
    peeks_before = c.stats()["peeks"]
    p = c.peek(keys)
    assert p.hit == 5 and p.prefix_by_node == {"h": 5}
    st = c.stats()
    assert st["locks"] == 0 and st["peeks"] == peeks_before + 1
    # A holder may free what was only peeked at, at once (a lookup's lock would keep it).
    assert c.unpublish_if_unlocked("h", keys) == keys
    assert c.peek(keys).hit == 0
    c.publish("h", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d")
    assert c.unpublish_if_unlocked("h", keys) == []  # the contrast: a lookup pins
    assert c.release(r.lock_id)


def test_peek_descriptions_are_cached_like_lookups(masters):
    m = masters.start()
    c = masters.client(m.address)
    keys = keys_for("cache", 3)
    c.register_node(serving_node("h", serve_url="http://10.0.0.5:8100", role="kv_producer"), 30)
    c.publish("h", [(k, [i]) for i, k in enumerate(keys)])
    first = c.peek(keys).nodes["h"]
    again = c.peek(keys).nodes["h"]  # sent as an epoch only this time: the client's copy
    assert first == again and again.serve_url == "http://10.0.0.5:8100" and again.role == "kv_producer"


def _raw_frame(op: int, doc: dict, blob: bytes = b"") -> bytes:
    return P.encode_frame(op, 7, doc, blob)


def test_malformed_peeks_are_refused_by_name(masters):
    m = masters.start()
    c = masters.client(m.address)
    keys = keys_for("bad", 2)
    joined = b"".join(keys)
    cases = [
        ({"n": 3, "have": {}}, joined, "blob"),  # announces 3 keys, carries 2
        ({"have": {}}, joined, "'n'"),
        ({"n": 2, "skip": ["a"]}, joined, "'skip'"),
        ({"n": 2, "skip": {"a": -1}}, joined, "'skip'"),
        ({"n": 2, "transport": ""}, joined, "'transport'"),
        ({"n": P.MAX_KEYS_PER_REQUEST + 1}, joined, "'n'"),
    ]
    for doc, blob, named in cases:
        err = _error_for(m.address, _raw_frame(P.OP_PEEK, doc, blob))
        assert err["err"] == P.ERR_MALFORMED and named in err["msg"], (doc, err)
    with pytest.raises(ValueError, match="key 1 must be 32 bytes"):
        c.peek([keys[0], b"short"])
    assert c.peek([]) == PeekResult(0, {}, {})
    assert c.stats()["bad_frames"] == len(cases)


def test_nodes_lists_the_live_registrations_with_their_serving_fields(address, masters):
    c = masters.client(address, timeout_s=5.0)
    full = serving_node("prefill-0", serve_url="http://10.0.0.5:8100", namespace="ab" * 32, chunk_tokens=256,
                        role="kv_producer")
    c.register_node(full, 30)
    c.register_node(serving_node("decode-0", serve_url="https://d0:8200", role="kv_consumer"), 30)
    c.register_node(node_info("old"), 30)  # a registration without the new fields (as before them)
    c.register_node(node_info("brief"), 0.4)
    c.register_node(node_info("gone"), 30)
    c.deregister_node("gone")
    time.sleep(0.6)
    listed = {n.node_id: n for n in c.nodes()}
    assert set(listed) == {"prefill-0", "decode-0", "old"}
    assert listed["prefill-0"] == full
    d = listed["decode-0"]
    assert (d.serve_url, d.namespace, d.chunk_tokens, d.role) == ("https://d0:8200", "", 0, "kv_consumer")
    o = listed["old"]
    assert (o.serve_url, o.namespace, o.chunk_tokens, o.role) == ("", "", 0, "")
    assert o.transport_metadata == b"meta-old" and o.layout == {"v": 1, "block_size": 16}
    # Lookups describe holders with the same fields.
    keys = keys_for("desc", 2)
    c.publish("prefill-0", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d")
    assert r.nodes["prefill-0"] == full
    assert c.release(r.lock_id)


def test_registration_without_new_fields_is_byte_for_byte_as_before():
    from pdxfer.master.wire import ops as ops

    req = ops.encode_register(node_info("old"), 10.0)
    assert not {"serve_url", "ns", "ct", "role"} & req.doc.keys()
    back = ops.decode_register(req.doc, req.blob)
    assert back.serving == ops.Serving()


@pytest.mark.parametrize(("fields", "named"), [
    ({"role": "router"}, "'role'"),
    ({"serve_url": "ftp://x"}, "'serve_url'"),
    ({"namespace": "XYZ"}, "'ns'"),
    ({"chunk_tokens": -1}, "'ct'"),
])
def test_bad_serving_fields_are_refused_by_name(masters, fields, named):
    m = masters.start()
    c = masters.client(m.address)
    with pytest.raises(MasterProtocolError, match=named):
        c.register_node(serving_node("x", **fields), 30)
    assert c.nodes() == []


@pytest.mark.etcd
def test_etcd_membership_mirror_carries_the_serving_fields(etcd, masters):
    m = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(m.address), 10, "the replica to lead")
    c = masters.client(f"etcd://{etcd.endpoint}{PREFIX}", timeout_s=5.0)
    c.register_node(serving_node("p", serve_url="http://p:1", namespace="0f", chunk_tokens=16, role="kv_both"), 30)
    key = f"{PREFIX}/nodes/p"
    raw = wait_until(lambda: etcd_keys(etcd.endpoint, PREFIX).get(key), 5, "the node's membership key")
    doc = json.loads(raw)
    assert (doc["serve_url"], doc["ns"], doc["ct"], doc["role"]) == ("http://p:1", "0f", 16, "kv_both")


@pytest.mark.etcd
def test_peek_and_nodes_refused_by_a_standby(etcd, masters):
    a = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(a.address), 10, "first replica to lead")
    b = masters.start(extra_args=ha_args(etcd))
    time.sleep(0.5)
    assert role(b.address) is False
    for op in (P.OP_PEEK, P.OP_NODES):
        err = _error_for(b.address, _raw_frame(op, {"n": 0} if op == P.OP_PEEK else {}))
        assert err["err"] == P.ERR_NOT_LEADER, err
