"""HA on a real etcd: leader election, failover after killing the leader process, clients that
follow the leader, nodes re-publishing to the new leader, degraded mode when etcd dies."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest

from pdxfer.master import MasterClient, MasterUnavailable, NodeSession, NotLeader

from .conftest import keys_for, master_value, node_info, wait_until

pytestmark = pytest.mark.etcd

PREFIX = "/pdxfer-test/master"


def etcd_keys(endpoint: str, prefix: str) -> dict[str, bytes]:
    """All keys under ``prefix`` via etcd's JSON gateway."""
    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    req = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=json.dumps({"key": base64.b64encode(start).decode(),
                         "range_end": base64.b64encode(end).decode()}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=2) as r:
        doc = json.loads(r.read())
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]) for kv in doc.get("kvs", [])}


def ha_args(etcd) -> tuple[str, ...]:
    return ("--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--leader-ttl", "2", "--etcd-timeout", "0.5")


def role(address: str) -> bool | None:
    try:
        with MasterClient(address, timeout_s=0.5) as c:
            return c.ping()["leader"]
    except MasterUnavailable:
        return None


def test_failover_kill_leader_standby_takes_over(etcd, masters):
    a = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(a.address), 10, "first replica to lead")
    b = masters.start(extra_args=ha_args(etcd))
    time.sleep(0.5)
    assert role(b.address) is False  # standby
    assert json.loads(etcd_keys(etcd.endpoint, PREFIX)[f"{PREFIX}/leader"])["addr"] == a.address

    url = f"etcd://{etcd.endpoint}{PREFIX}"
    c = masters.client(url, timeout_s=1.0)
    keys = keys_for("ha", 4)
    republished = []

    def republish() -> None:
        republished.append(c.publish("holder", [(k, [i]) for i, k in enumerate(keys)]))

    s = NodeSession(c, node_info("holder"), lease_ttl_s=1.5, on_reregistered=republish)
    s.start()
    try:
        c.publish("holder", [(k, [i]) for i, k in enumerate(keys)])
        r = c.lookup_and_lock(keys, reader="d", lock_ttl_s=30)
        assert r.hit_chunks == 4
        # the leader mirrors the node in etcd under a lease
        wait_until(lambda: f"{PREFIX}/nodes/holder" in etcd_keys(etcd.endpoint, PREFIX), 3, "node key in etcd")
        # a standby refuses the hot path and names the leader
        with MasterClient(b.address, timeout_s=1.0) as direct:
            with pytest.raises(MasterUnavailable, match="standby"):
                direct.lookup_and_lock(keys, reader="d")

        a.kill()  # SIGKILL: no goodbye, its lease must run out
        t0 = time.monotonic()
        wait_until(lambda: role(b.address), 10, "standby to take over")
        took_over = time.monotonic() - t0

        def hits() -> int:
            try:
                return c.lookup_and_lock(keys, reader="d").hit_chunks
            except MasterUnavailable:
                return 0

        wait_until(lambda: hits() == 4, 10, "clients to continue after nodes re-publish", interval_s=0.1)
        assert republished and republished[-1] == 4 and s.reregistrations >= 1
        # the lock granted by the dead leader is meaningless to the new one
        assert c.release(r.lock_id) is False
        st = c.stats()
        assert st["leader"] is True and st["nodes"] == 1 and st["entries"] == 4
        assert took_over < 8
    finally:
        s.stop()
    # deregistration removes the membership key (lease revoked) promptly
    wait_until(lambda: f"{PREFIX}/nodes/holder" not in etcd_keys(etcd.endpoint, PREFIX), 3, "node key removed")


def test_node_membership_key_expires_with_node_lease(etcd, masters):
    m = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(m.address), 10, "replica to lead")
    c = masters.client(m.address)
    c.register_node(node_info("quiet"), lease_ttl_s=1.0)
    c.publish("quiet", [(keys_for("q", 1)[0], [1])])
    wait_until(lambda: f"{PREFIX}/nodes/quiet" in etcd_keys(etcd.endpoint, PREFIX), 3, "node key in etcd")
    wait_until(lambda: c.stats()["entries"] == 0, 3, "entries dropped with the node lease")
    wait_until(lambda: f"{PREFIX}/nodes/quiet" not in etcd_keys(etcd.endpoint, PREFIX), 5, "node key gone")


def test_etcd_killed_leader_serves_from_memory_while_its_lease_lasts(etcd, masters):
    # A lease long enough to observe degraded serving; it ends at most TTL after the last keepalive.
    ttl = 6
    m = masters.start(extra_args=("--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--leader-ttl", str(ttl),
                                  "--etcd-timeout", "0.5"))
    wait_until(lambda: role(m.address), 10, "replica to lead")
    c = masters.client(m.address)
    c.register_node(node_info("p"), lease_ttl_s=30)
    keys = keys_for("deg", 3)
    c.publish("p", [(k, [i]) for i, k in enumerate(keys)])
    etcd.kill()
    t_kill = time.monotonic()
    wait_until(lambda: c.stats()["degraded"], 8, "master to report degraded")
    with urllib.request.urlopen(f"http://{m.http_address}/health", timeout=2) as r:
        assert json.loads(r.read())["status"] == "degraded"
    # the hot path does not wait on etcd (an etcd call would cost its 0.5 s timeout)
    lat = []
    for _ in range(9):
        t0 = time.monotonic()
        r = c.lookup_and_lock(keys, reader="d")
        assert r.hit_chunks == 3 and c.release(r.lock_id) is True
        lat.append(time.monotonic() - t0)
    assert sorted(lat)[4] < 0.25, lat
    assert c.heartbeat("p") is True
    assert c.stats()["leader"] is True
    assert master_value(m.http_address, "pdxfer_master_degraded") == 1
    # its lease may have run out by its own clock: it stops serving (a standby could lead now)
    with pytest.raises(NotLeader, match="lease may have expired"):
        wait_until(lambda: c.lookup_and_lock(keys, reader="d") and False, ttl + 1, "the leader to stop serving")
    assert time.monotonic() - t_kill <= ttl + 0.5
    assert c.stats()["leader"] is False
    wait_until(lambda: c.stats()["nodes"] == 0, 3, "the index to be forgotten")
    # etcd back (same data dir): the master leads again (under its old lease if etcd kept it),
    # empty; the node re-registers and re-publishes as after a failover
    etcd.start()
    wait_until(lambda: c.stats()["leader"] and c.stats()["degraded"] is None, 20, "master to lead again")
    c.register_node(node_info("p"), lease_ttl_s=30)
    c.publish("p", [(k, [i]) for i, k in enumerate(keys)])
    assert c.lookup_and_lock(keys, reader="d").hit_chunks == 3


def test_leader_key_stolen_exactly_one_leader_remains(etcd, masters):
    """Delete the leader key under a live leader: whoever ends up holding it leads, the other
    steps down (clearing what it knew) - never two leaders once etcd is reachable."""
    a = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(a.address), 10, "first replica to lead")
    b = masters.start(extra_args=ha_args(etcd))
    ca = masters.client(a.address)
    ca.register_node(node_info("n"), 30)
    req = urllib.request.Request(
        f"http://{etcd.endpoint}/v3/kv/deleterange",
        data=json.dumps({"key": base64.b64encode(f"{PREFIX}/leader".encode()).decode()}).encode(), method="POST")
    for _ in range(5):  # give the standby several chances to win the race
        urllib.request.urlopen(req, timeout=2).read()
        time.sleep(0.3)

    def settled():
        roles = {m.address: role(m.address) for m in (a, b)}
        key = etcd_keys(etcd.endpoint, PREFIX).get(f"{PREFIX}/leader")
        leaders = [addr for addr, r in roles.items() if r]
        if len(leaders) == 1 and key is not None and json.loads(key)["addr"] == leaders[0]:
            return leaders[0]
        return None

    leader = wait_until(settled, 10, "exactly one leader matching the key")
    time.sleep(0.8)  # stays settled
    assert settled() == leader
    standby = b if leader == a.address else a
    st = masters.client(standby.address).stats()
    assert st["leader"] is False and st["nodes"] == 0  # a standby serves nothing it knew as leader


def test_graceful_stop_hands_over_before_lease_expiry(etcd, masters):
    """SIGTERM on the leader revokes its lease: the standby leads well before the TTL would end."""
    args = ("--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--leader-ttl", "30", "--etcd-timeout", "0.5")
    a = masters.start(extra_args=args)
    wait_until(lambda: role(a.address), 10, "first replica to lead")
    b = masters.start(extra_args=args)
    wait_until(lambda: role(b.address) is False, 10, "second replica to stand by")
    # a client whose first etcd endpoint is dead still finds the leader through the second
    from pdxfer.common.procs import free_port

    c = masters.client(f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}{PREFIX}", timeout_s=2.0)
    assert c.stats()["leader_address"] == a.address
    t0 = time.monotonic()
    assert a.stop() == 0
    wait_until(lambda: role(b.address), 10, "standby to take over after a graceful stop")
    assert time.monotonic() - t0 < 15  # without the revoke it would wait out the 30 s lease
    assert wait_until(lambda: c.stats()["leader_address"] == b.address, 5, "client to follow the new leader")
