"""Per-op codecs (protocol_ops.py): what the client encodes the service decodes to the same values,
and back; every bad field is refused with an error naming it. Also the URL schemes that choose a
coordinator (service side) and a locator (client side), which must agree on the etcd layout."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdxfer.master import MasterClient, MasterProtocolError, MasterUnavailable, NodeInfo
from pdxfer.master.backends import etcd_layout
from pdxfer.master.wire import protocol as P
from pdxfer.master.wire import ops as ops
from pdxfer.master.backends.coordinator import Standalone
from pdxfer.master.backends.choice import coordinator_for
from pdxfer.master.client.locations import ChunkLocations
from pdxfer.master.wire.records import ChunkLocation
from pdxfer.master.client.locator import EtcdLocator, StaticLocator, locator_for
from pdxfer.common.procs import free_port

from .conftest import keys_for


def _over_the_wire(req: ops.Request) -> tuple[dict, memoryview]:
    """What the service sees of a request: the frame encoded, its header parsed, JSON decoded."""
    frame = P.encode_frame(req.op, 1, req.doc, req.blob)
    hdr = P.parse_header(frame[: P.HEADER_BYTES])
    body = frame[P.HEADER_BYTES :]
    return P.decode_json(body[: hdr.json_len]), memoryview(body)[hdr.json_len :]


def test_requests_round_trip():
    info = NodeInfo("n1", 3, "tcp", b"\x00meta\xff", {"layers": 2, "blocks": [1, 2]}, "fp-1")
    reg = ops.decode_register(*_over_the_wire(ops.encode_register(info, 7.5)))
    assert (reg.node_id, reg.rank, reg.transport, reg.layout, reg.fingerprint, reg.ttl, reg.metadata) == (
        "n1", 3, "tcp", {"layers": 2, "blocks": [1, 2]}, "fp-1", 7.5, b"\x00meta\xff")

    keys = keys_for("ops", 3)
    pub = ops.decode_publish(*_over_the_wire(ops.encode_publish("n1", [(keys[0], [1, 2]), (keys[1], []),
                                                                     (keys[2], [7])], 30.0, 5, 3)))
    assert pub.node_id == "n1" and pub.epoch == 5 and pub.seq == 3 and pub.retention_s == 30.0
    assert [(k, P.unpack_u32(b)) for k, b in pub.items] == [(keys[0], [1, 2]), (keys[1], []), (keys[2], [7])]
    uniform = ops.encode_publish("n1", [(k, [i, i]) for i, k in enumerate(keys)], None, 5, 1)
    assert uniform.doc["per"] == 2 and "counts" not in uniform.doc and "ret" not in uniform.doc
    assert ops.decode_publish(*_over_the_wire(uniform)).retention_s is None

    look = ops.decode_lookup(*_over_the_wire(ops.encode_lookup(P.join_keys(keys), "r", 2.0, {"n1": 4})))
    assert (look.keys, look.reader, look.ttl, look.have) == (keys, "r", 2.0, {"n1": 4})

    assert ops.decode_unpublish(*_over_the_wire(ops.encode_unpublish("n1", keys[:2], 7))) == (("n1", 7), keys[:2], None)
    assert ops.decode_unpublish(*_over_the_wire(ops.encode_unpublish("n1", keys[:1], 7, 9))).fence == 9
    assert ops.decode_fence(*_over_the_wire(ops.encode_fence("n1", 7, 9))) == (("n1", 7), 9)
    assert ops.decode_hello(*_over_the_wire(ops.encode_hello("s3cret"))) == "s3cret"
    assert ops.decode_hello(*_over_the_wire(ops.encode_hello(None))) is None
    assert ops.decode_release(*_over_the_wire(ops.encode_release("ab-1"))) == ("ab-1", False)
    assert ops.decode_release(*_over_the_wire(ops.encode_release("ab-1", all_parties=True))) == ("ab-1", True)
    look2 = ops.decode_lookup(*_over_the_wire(ops.encode_lookup(P.join_keys(keys), "r", 2.0, {}, parties=4)))
    assert look2.parties == 4 and look.parties == 1
    assert ops.decode_heartbeat(*_over_the_wire(ops.encode_heartbeat("n1", 7))) == ("n1", 7)
    assert ops.decode_deregister(*_over_the_wire(ops.encode_deregister("n1", 7))) == ("n1", 7)


def test_replies_round_trip():
    reg = ops.decode_register_reply(ops.encode_register_reply(5, 2.0, 30.0), b"", "n1")
    assert (reg.node_id, reg.epoch, reg.lease_ttl_s, reg.max_lock_ttl_s) == ("n1", 5, 2.0, 30.0)
    assert ops.decode_heartbeat_reply(ops.encode_heartbeat_reply(None), b"") is False
    assert ops.decode_heartbeat_reply(ops.encode_heartbeat_reply(3.0), b"") is True
    assert ops.decode_release_reply(ops.encode_release_reply(True), b"") is True
    assert ops.decode_publish_reply(ops.encode_publish_reply(3), b"", 3) == 3
    assert ops.decode_unpublish_reply(ops.encode_unpublish_reply([0, 2]), b"", 3) == [0, 2]
    assert ops.decode_fence_reply(ops.encode_fence_reply(9), b"") == 9
    assert ops.decode_ping_reply(ops.encode_ping_reply(False, "h:1"), b"")["leader_address"] == "h:1"

    reg = ops.RegisterRequest("p", 0, "nixl", {"v": 1}, "fp", 5.0, b"m" * 10)
    described = ops.encode_node_description(reg, epoch=4)
    nodes = [("p", 4, described), ("q", 9, ops.encode_node_description(reg, epoch=9))]
    head = ops.encode_lookup_reply("L-1", 3, 2.0, [("p", 2), ("q", 1)], [2, 2, 1], nodes, have={"q": 9})
    doc = P.decode_json(head)
    reply = ops.decode_lookup_reply(doc, P.pack_u32([1, 2, 3, 4, 5]), asked=4)
    assert (reply.lock_id, reply.hit, reply.ttl) == ("L-1", 3, 2.0)
    assert reply.holders == ["p", "p", "q"] and reply.block_lists == [[1, 2], [3, 4], [5]]
    epoch, info = reply.nodes["p"]
    assert epoch == 4 and info == NodeInfo("p", 0, "nixl", b"m" * 10, {"v": 1}, "fp")
    assert reply.nodes["q"] == (9, None)  # the client said it has q at epoch 9: epoch only
    miss = ops.decode_lookup_reply(P.decode_json(ops.encode_lookup_reply(None, 0, 2.0, [], [], [], {})), b"", 4)
    assert (miss.lock_id, miss.hit, miss.block_lists) == (None, 0, [])


def test_lookup_reply_locations_built_on_first_use_equal_the_list():
    keys = [bytes([i]) * 32 for i in range(5)]
    for runs, counts, ids in ((([("p", 3), ("q", 1)]), [2, 2, 2, 2], list(range(8))),
                              (([("p", 1), ("q", 3)]), [3, 0, 1, 2], [7, 8, 9, 4, 5, 6])):
        head = ops.encode_lookup_reply("L", 4, 2.0, runs, counts, [("p", 1, "{}"), ("q", 1, "{}")], {"p": 1, "q": 1})
        reply = ops.decode_lookup_reply(P.decode_json(head), P.pack_u32(ids), asked=5)
        want, at = [], 0
        for j, node in enumerate(n for n, c in runs for _ in range(c)):
            want.append(ChunkLocation(keys[j], node, ids[at : at + counts[j]]))
            at += counts[j]
        locs = ChunkLocations(keys, reply)
        assert len(locs) == 4 and locs._items is None  # the length needs no objects
        assert locs == want and list(locs) == want and locs[1] == want[1] and locs[-1] == want[-1]
        assert locs[1:3] == want[1:3] and [loc.key for loc in locs] == keys[:4]
        assert locs != want[:3] and locs[0] is locs[0]  # built once: the same objects every time


@pytest.mark.parametrize("doc,blob", [
    ({"per": 2}, P.pack_u32(range(7))),  # 4 chunks of 2 ids need 8
    ({"per": 0}, P.pack_u32(range(1))),
    ({"counts": [2, 2, 2, 1]}, P.pack_u32(range(8))),
    ({"per": 2}, b"\0" * 30),  # not whole uint32s
])
def test_lookup_reply_block_ids_must_match_the_counts(doc, blob):
    base = {"lock": "L", "hit": 4, "ttl": 1.0, "runs": [["p", 4]], "nodes": {"p": {"epoch": 1}}}
    with pytest.raises(P.ProtocolError):
        ops.decode_lookup_reply({**base, **doc}, blob, asked=4)


@pytest.mark.parametrize("decode,doc,blob,field", [
    (ops.decode_publish, {"node_id": "n", "epoch": 1, "seq": 1, "n": 2, "counts": [1]}, b"", "'counts'"),
    (ops.decode_publish, {"node_id": "n", "epoch": 1, "seq": 1, "n": 1, "per": -1}, b"", "'per'"),
    (ops.decode_publish, {"node_id": "n", "epoch": 1, "seq": 1, "n": 1, "per": 1, "ret": "long"}, b"k" * 32 + b"\0" * 4,
     "'ret'"),
    (ops.decode_publish, {"node_id": "n", "n": 1, "per": 1}, b"k" * 32 + b"\0" * 4, "'epoch'"),
    (ops.decode_publish, {"node_id": "n", "epoch": 1, "seq": 0, "n": 0}, b"", "'seq'"),
    (ops.decode_fence, {"node_id": "n", "epoch": 1, "upto": "x"}, b"", "'upto'"),
    (ops.decode_heartbeat, {"node_id": "n", "epoch": -1}, b"", "'epoch'"),
    (ops.decode_register, {"node_id": "n", "rank": 0, "transport": "t", "fp": "f", "layout": [], "ttl": 1},
     b"", "'layout'"),
    (ops.decode_register, {"node_id": "n", "rank": -1}, b"", "'rank'"),
    (ops.decode_lookup, {"n": 1, "reader": "", "ttl": 1}, b"k" * 32, "'reader'"),
    (ops.decode_lookup, {"n": 1, "reader": "r", "ttl": 0}, b"k" * 32, "'ttl'"),
    (ops.decode_release, {"lock": 5}, b"", "'lock'"),
    (ops.decode_unpublish, {"node_id": "n", "epoch": 1, "n": 2}, b"k" * 32, "announce 64"),
])
def test_bad_request_fields_are_named(decode, doc, blob, field):
    with pytest.raises(P.ProtocolError, match=field) as info:
        decode(doc, memoryview(blob))
    assert info.value.code == P.ERR_MALFORMED


@pytest.mark.parametrize("doc,blob,field", [
    ({"hit": 5, "ttl": 1.0}, b"", "'hit'"),
    ({"hit": 1, "ttl": 1.0, "lock": "L", "runs": [["p", 0]], "per": 1, "nodes": {}}, b"\0" * 4, "'runs'"),
    ({"hit": 1, "ttl": 1.0, "lock": "L", "runs": [["p", 1]], "per": 1, "nodes": {}}, b"\0" * 4, "'nodes'"),
    ({"hit": 1, "ttl": 1.0, "lock": "L", "runs": [["p", 1]], "per": 1, "nodes": {"p": {"epoch": 1, "meta": "!!",
      "layout": {}, "rank": 0, "transport": "t", "fp": "f"}}}, b"\0" * 4, "'meta'"),
    ({"hit": 1, "ttl": 1.0, "lock": "L", "runs": [["p", 1]], "per": 2, "nodes": {"p": {"epoch": 1}}},
     b"\0" * 4, "inconsistent"),
])
def test_bad_lookup_reply_fields_are_named(doc, blob, field):
    with pytest.raises(P.ProtocolError, match=field):
        ops.decode_lookup_reply(doc, blob, asked=2)


def test_client_names_the_bad_field_of_a_misbehaving_master():
    """A peer that answers a publish with a negative count: MasterProtocolError naming the field."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer_once() -> None:
        conn, _ = srv.accept()
        with conn:
            hdr = P.parse_header(conn.recv(P.HEADER_BYTES, socket.MSG_WAITALL))
            conn.recv(hdr.json_len + hdr.blob_len, socket.MSG_WAITALL)
            conn.sendall(P.encode_frame(hdr.op | P.REPLY_BIT, hdr.req_id, {"accepted": -1}))

    t = threading.Thread(target=answer_once, daemon=True)
    t.start()
    try:
        with MasterClient("127.0.0.1:%d" % srv.getsockname()[1], timeout_s=5) as c:
            with pytest.raises(MasterProtocolError, match="bad publish reply.*'accepted'"):
                c.publish("n", [(keys_for("bad", 1)[0], [1])], epoch=1)
    finally:
        t.join(5)
        srv.close()


def test_coordinator_and_locator_chosen_by_scheme():
    assert isinstance(coordinator_for(None), Standalone) and isinstance(coordinator_for(""), Standalone)
    with pytest.raises(ValueError, match="'zk://h:1/x'.*unknown scheme"):
        coordinator_for("zk://h:1/x")
    with pytest.raises(ValueError, match="etcd endpoint 'nohost'"):
        coordinator_for("etcd://nohost/x")
    assert isinstance(locator_for("10.0.0.1:7000"), StaticLocator)
    with pytest.raises(ValueError, match="'http://h:1'.*unknown scheme"):
        locator_for("http://h:1")
    with pytest.raises(ValueError, match="'h:port'"):
        locator_for("h:port")

    url = "etcd://127.0.0.1:1,127.0.0.1:2/team/master/"
    loc = locator_for(url)
    assert isinstance(loc, EtcdLocator)
    assert loc.target == etcd_layout.EtcdTarget([("127.0.0.1", 1), ("127.0.0.1", 2)], "/team/master")
    assert etcd_layout.parse_etcd_url("etcd://h:1").prefix == etcd_layout.DEFAULT_PREFIX
    assert etcd_layout.parse_etcd_url(etcd_layout.etcd_url("h:1", "/a/b")).prefix == "/a/b"
    pytest.importorskip("aetcd")
    coord = coordinator_for(url, leader_ttl=2.5)
    # The writer and the reader take the leader key from the same place.
    assert coord.leader_key == etcd_layout.leader_key(loc.target.prefix) == b"/team/master/leader"
    assert coord.leader_ttl == 3  # etcd leases have whole seconds


def test_leader_record_encoding_and_a_dead_etcd():
    rec = etcd_layout.decode_leader(etcd_layout.encode_leader("10.0.0.5:7000", "r1"))
    assert rec == etcd_layout.LeaderRecord("10.0.0.5:7000", "r1")
    for bad in (b"not json", b'{"addr": "x"}', b'{"addr": "nohostport", "id": "r"}', b'{"addr": 5, "id": "r"}'):
        with pytest.raises(ValueError):
            etcd_layout.decode_leader(bad)
    loc = EtcdLocator(f"etcd://127.0.0.1:{free_port()}/x")
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailable, match="no etcd endpoint answered"):
        loc.locate(0.5)
    assert time.monotonic() - t0 < 3


def test_a_silent_etcd_endpoint_does_not_use_up_the_budget_of_the_others():
    """A member cut off by the network accepts nothing and answers nothing; the locator gave the
    first endpoint its whole budget, so a silent first member hid every healthy one behind it."""
    import base64
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections queue in the backlog; nothing ever reads them

    leader = base64.b64encode(etcd_layout.encode_leader("10.0.0.7:7000", "r1")).decode()

    class Member(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # /v3/kv/range of the leader key
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"kvs": [{"value": leader}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    member = ThreadingHTTPServer(("127.0.0.1", 0), Member)
    threading.Thread(target=member.serve_forever, daemon=True).start()
    try:
        loc = EtcdLocator(f"etcd://127.0.0.1:{silent.getsockname()[1]},127.0.0.1:{member.server_port}/x")
        t0 = time.monotonic()
        assert loc.locate(2.0) == ("10.0.0.7", 7000)
        assert time.monotonic() - t0 < 1.8
    finally:
        member.shutdown()
        silent.close()


def test_join_keys_refuses_any_key_that_is_not_32_bytes_even_when_the_total_fits():
    """A 31-byte key next to a 33-byte one adds up to 64 bytes: joined, every later key would be
    read one byte off on the master. join_keys names the first bad key instead."""
    keys = keys_for("join", 4)
    assert P.join_keys(keys) == b"".join(keys) and P.join_keys([]) == b""
    assert P.join_keys([bytearray(k) for k in keys]) == b"".join(keys)
    cases = [
        ([keys[0], keys[1][:31], keys[2] + b"x", keys[3]], "key 1"),  # the total is 4 x 32
        ([keys[0], keys[1] + b"x"], "key 1"),
        ([keys[0][:31]], "key 0"),
        ([keys[0], keys[1].hex()], "key 1"),  # not bytes at all
        ([keys[0], None], "key 1"),
    ]
    for bad, named in cases:
        with pytest.raises(ValueError, match=f"{named} must be 32 bytes"):
            P.join_keys(bad)
