"""The master as a real process, through the real client: semantics, leases, auth, HTTP."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from pdxfer.master import (
    MasterAuthError,
    MasterClient,
    MasterUnavailable,
    NodeSession,
    UnknownNode,
    start_local_master,
)

from .conftest import keys_for, node_info, sample_value, scrape_master, wait_until


def test_contiguous_prefix_and_locations(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("p0"), lease_ttl_s=30)
    keys = keys_for("prompt", 6)
    held = [0, 1, 3, 4, 5]  # chunk 2 missing
    assert c.publish("p0", [(keys[i], [10 * i, 10 * i + 1]) for i in held]) == 5
    r = c.lookup_and_lock(keys, reader="d0")
    assert r.hit_chunks == 2  # the miss at chunk 2 hides chunks 3..5
    assert [loc.block_ids for loc in r.locations] == [[0, 1], [10, 11]]
    assert [loc.key for loc in r.locations] == keys[:2]
    assert r.nodes["p0"].transport_metadata == b"meta-p0"
    assert r.nodes["p0"].layout == {"v": 1, "block_size": 16}
    assert r.nodes["p0"].layout_fingerprint == "fp-test"
    assert c.release(r.lock_id) is True
    # fill the hole: now the whole prompt is held; uneven block counts travel too
    assert c.publish("p0", [(keys[2], [20, 21, 22])]) == 1
    r = c.lookup_and_lock(keys, reader="d0")
    assert r.hit_chunks == 6
    assert r.locations[2].block_ids == [20, 21, 22] and r.locations[5].block_ids == [50, 51]
    miss = c.lookup_and_lock(keys_for("other", 3), reader="d0")
    assert miss.hit_chunks == 0 and miss.lock_id is None and miss.locations == []


def test_two_holders_longest_prefix_wins(master, masters):
    c = masters.client(master.address)
    keys = keys_for("two", 8)
    c.register_node(node_info("short"), 30)
    c.register_node(node_info("long"), 30)
    c.publish("short", [(k, [1]) for k in keys[:3]])
    c.publish("long", [(k, [2]) for k in keys[:6]])
    r = c.lookup_and_lock(keys, reader="d")
    assert r.hit_chunks == 6 and {loc.node_id for loc in r.locations} == {"long"}
    assert set(r.nodes) == {"long"}


def test_two_holders_of_the_same_chunks_share_the_reads(master, masters):
    c = masters.client(master.address)
    keys = keys_for("copies", 4)
    for nid in ("copy-a", "copy-b", "short"):
        c.register_node(node_info(nid), 30)
    c.publish("copy-a", [(k, [1]) for k in keys])
    c.publish("copy-b", [(k, [2]) for k in keys])
    c.publish("short", [(k, [3]) for k in keys[:3]])
    chosen = []
    for _ in range(4):
        r = c.lookup_and_lock(keys, reader="d")
        holders = {loc.node_id for loc in r.locations}
        assert r.hit_chunks == 4 and len(holders) == 1, holders  # one holder for the whole run
        chosen += holders
        assert c.release(r.lock_id)
    assert sorted(chosen) == ["copy-a", "copy-a", "copy-b", "copy-b"]
    c.register_node(node_info("longer"), 30)
    longer = keys + keys_for("copies-more", 1)
    c.publish("longer", [(k, [4]) for k in longer])
    for _ in range(3):
        r = c.lookup_and_lock(longer, reader="d")
        assert r.hit_chunks == 5 and {loc.node_id for loc in r.locations} == {"longer"}
        assert c.release(r.lock_id)


def test_lock_expiry_then_release_says_expired(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("p"), 30)
    keys = keys_for("exp", 2)
    c.publish("p", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d", lock_ttl_s=0.3)
    assert r.hit_chunks == 2 and r.lock_ttl_s == pytest.approx(0.3)
    time.sleep(0.45)
    assert c.release(r.lock_id) is False  # the entry still exists, but the lock is over
    r2 = c.lookup_and_lock(keys, reader="d", lock_ttl_s=5)
    assert c.release(r2.lock_id) is True
    assert c.release(r2.lock_id) is False
    assert c.release("no-such-lock") is False


def test_unpublish_refused_while_locked_and_allowed_after(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("p"), 30)
    keys = keys_for("unpub", 3)
    c.publish("p", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys[:2], reader="d", lock_ttl_s=5)
    assert c.unpublish_if_unlocked("p", keys) == [keys[2]]
    # Locked ones kept; the gone one is reported again (absent: free to reuse).
    assert c.unpublish_if_unlocked("p", keys) == [keys[2]]
    assert c.release(r.lock_id) is True
    assert c.unpublish_if_unlocked("p", keys) == keys  # the locked two removed, the third still absent
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 0
    with pytest.raises(UnknownNode):
        c.unpublish_if_unlocked("nobody", keys)


def test_node_lease_expiry_drops_entries_and_locks(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("dies"), lease_ttl_s=0.5)
    keys = keys_for("lease", 4)
    c.publish("dies", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d", lock_ttl_s=30)
    assert r.hit_chunks == 4
    wait_until(lambda: c.stats()["nodes"] == 0, 3.0, "node lease to expire")
    st = c.stats()
    assert st["entries"] == 0 and st["locks"] == 0 and st["nodes_expired"] == 1
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 0
    assert c.release(r.lock_id) is False  # its 30 s lock did not outlive the node's lease
    assert c.heartbeat("dies") is False
    with pytest.raises(UnknownNode):
        c.publish("dies", [(keys[0], [1])])


def test_node_session_keeps_lease_and_deregisters(master, masters):
    c = masters.client(master.address)
    s = NodeSession(c, node_info("alive"), lease_ttl_s=0.6)
    s.start()
    try:
        keys = keys_for("alive", 2)
        c.publish("alive", [(k, [0]) for k in keys])
        time.sleep(1.5)  # 2.5 lease times: only heartbeats keep it
        assert c.lookup_and_lock(keys, reader="d").hit_chunks == 2
        assert s.reregistrations == 0
    finally:
        s.stop(deregister=True)
    st = c.stats()
    assert st["nodes"] == 0 and st["entries"] == 0


def test_node_session_reregisters_and_republishes_after_master_restart(masters, tmp_path):
    from pdxfer.common.procs import free_port

    port = free_port()
    m1 = masters.start(extra_args=("--port", str(port)))
    c = masters.client(m1.address, timeout_s=1.0)
    keys = keys_for("restart", 3)
    republished = threading.Event()

    def republish():
        c.publish("holder", [(k, [i]) for i, k in enumerate(keys)])
        republished.set()

    s = NodeSession(c, node_info("holder"), lease_ttl_s=0.9, on_reregistered=republish)
    s.start()
    try:
        c.publish("holder", [(k, [i]) for i, k in enumerate(keys)])
        m1.kill()
        with pytest.raises(MasterUnavailable):
            c.lookup_and_lock(keys, reader="d")
        masters.start(extra_args=("--port", str(port)))  # a new, empty master at the same address
        assert republished.wait(5.0), "NodeSession did not re-register and call on_reregistered"
        assert c.lookup_and_lock(keys, reader="d").hit_chunks == 3
    finally:
        s.stop()


def test_deregister_drops_entries(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("x"), 30)
    keys = keys_for("dereg", 2)
    c.publish("x", [(k, [1]) for k in keys])
    r = c.lookup_and_lock(keys, reader="d")
    c.deregister_node("x")
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 0
    assert c.release(r.lock_id) is False


def test_retention(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("r"), 30)
    keys = keys_for("ret", 1)
    c.publish("r", [(keys[0], [3])], retention_s=0.3)
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 1
    time.sleep(0.6)  # past hold-until: no longer served
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 0


def test_token_required_refused_and_logged(masters):
    m = masters.start(token="s3cret")
    good = masters.client(m.address, token="s3cret")
    good.register_node(node_info("t"), 30)
    for bad in (None, "wrong"):
        c = masters.client(m.address, token=bad)
        with pytest.raises(MasterAuthError):
            c.register_node(node_info("evil"), 30)
        with pytest.raises(MasterAuthError):
            c.stats()
    st = good.stats()
    assert st["nodes"] == 1 and st["auth_failures"] == 4
    with open(m.log_path) as f:
        log = f.read()
    assert "missing token" in log and "wrong token" in log


def test_concurrent_threads_share_one_client(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("p"), 30)
    keys = keys_for("conc", 64)
    c.publish("p", [(k, [i, i + 1]) for i, k in enumerate(keys)])
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for _ in range(50):
                r = c.lookup_and_lock(keys[: 1 + n * 10], reader=f"t{n}")
                assert r.hit_chunks == 1 + n * 10
                assert r.locations[-1].block_ids == [n * 10, n * 10 + 1]
                assert c.release(r.lock_id)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors
    assert c.stats()["locks"] == 0


def test_metrics_and_health(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("m"), 30)
    keys = keys_for("met", 3)
    c.publish("m", [(k, [1]) for k in keys])
    c.lookup_and_lock(keys, reader="d")
    fams = scrape_master(master.http_address)
    assert sample_value(fams, "pdxfer_master_entries") == 3
    assert sample_value(fams, "pdxfer_master_hit_chunks_total") == 3
    assert sample_value(fams, "pdxfer_master_hit_tokens_total") == 768
    assert sample_value(fams, "pdxfer_master_locks") == 1
    with urllib.request.urlopen(f"http://{master.http_address}/health", timeout=2) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "ok" and doc["store"] == "memory"


def test_unreachable_master_fails_within_timeout(tmp_path):
    from pdxfer.common.procs import free_port

    c = MasterClient(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailable):
        c.lookup_and_lock(keys_for("x", 1), reader="d")
    assert time.monotonic() - t0 < 1.5  # timeout 0.5 s, slack for a loaded CI machine


def test_silent_master_times_out(tmp_path):
    """A master that accepts but never answers (stopped process) costs at most timeout_s."""
    import os
    import signal

    m = start_local_master(workdir=str(tmp_path))
    try:
        c = MasterClient(m.address, timeout_s=0.5)
        c.ping()
        os.kill(m.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(MasterUnavailable):
            c.lookup_and_lock(keys_for("x", 1), reader="d")
        assert time.monotonic() - t0 < 1.5  # timeout 0.5 s, slack for a loaded CI machine
    finally:
        m.kill()


@pytest.mark.parametrize("cut_in", ["header", "body"])
def test_a_master_trickling_its_reply_costs_at_most_timeout_s(cut_in):
    """A reply sent a byte at a time (a wedged or hostile master) must not stretch the call: the
    whole call is under timeout_s, not each receive. Sent to the client over a real socket."""
    import socket

    from pdxfer.master.wire import protocol as P

    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            hdr = P.parse_header(conn.recv(P.HEADER_BYTES, socket.MSG_WAITALL))
            conn.recv(hdr.json_len + hdr.blob_len, socket.MSG_WAITALL)
            body = b'{"pad":"' + b"x" * 200 + b'"}'
            reply = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, hdr.op | P.REPLY_BIT, hdr.req_id, len(body), 0) + body
            if cut_in == "body":
                conn.sendall(reply[: P.HEADER_BYTES])
                reply = reply[P.HEADER_BYTES :]
            for i in range(len(reply)):  # one byte every 0.1 s: each receive alone is well under its timeout
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(reply[i : i + 1])
                except OSError:
                    return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        c = MasterClient("127.0.0.1:%d" % srv.getsockname()[1], timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(MasterUnavailable):
            c.ping()
        assert time.monotonic() - t0 < 1.5  # timeout 0.5 s (+ 50 ms slack), more for a loaded CI machine
        c.close()
    finally:
        stop.set()
        srv.close()
        t.join(5)


def test_a_value_json_cannot_carry_is_refused_before_sending(master, masters):
    """An integer past 64 bits fails in the client with the op named; the connection stays usable."""
    c = masters.client(master.address)
    c.register_node(node_info("big"), lease_ttl_s=30)
    with pytest.raises(ValueError, match="heartbeat frame cannot be sent as JSON"):
        c.heartbeat("big", epoch=1 << 70)
    assert c.heartbeat("big") is True


def test_node_descriptions_cached_per_epoch(master, masters):
    """The client tells the master which node descriptions it has; a new incarnation is re-sent."""
    from pdxfer.master import NodeInfo

    c = masters.client(master.address)
    keys = keys_for("epoch", 2)
    c.register_node(NodeInfo("p", 0, "tcp", b"first", {"layers": 2}, "fp"), 30)
    c.publish("p", [(k, [1]) for k in keys])
    r1 = c.lookup_and_lock(keys, reader="d")
    r2 = c.lookup_and_lock(keys, reader="d")
    assert r2.nodes["p"] is r1.nodes["p"] and r2.nodes["p"].transport_metadata == b"first"
    c.register_node(NodeInfo("p", 0, "tcp", b"second", {"layers": 3}, "fp"), 30)  # restarted holder
    c.publish("p", [(k, [2]) for k in keys])
    r3 = c.lookup_and_lock(keys, reader="d")
    assert r3.nodes["p"].transport_metadata == b"second" and r3.nodes["p"].layout == {"layers": 3}
    assert r3.locations[0].block_ids == [2]
    # a second client (empty cache) gets the full description
    other = masters.client(master.address)
    assert other.lookup_and_lock(keys, reader="d2").nodes["p"].transport_metadata == b"second"
