"""The one way to start a pdxfer-master as a child process (tests, benchmarks, ``pdxfer launch``).

``start_local_master()`` runs ``python -m pdxfer.master.service`` in its own process group on
OS-chosen ports, waits (bounded) until it has written its port file and answers a ping, and
returns a handle with its address and ``stop()`` / ``kill()``.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pdxfer.master.client.master_client import MasterClient
from pdxfer.master.wire.errors import MasterError
from pdxfer.common.procs import ManagedProcess, python_env, read_port_file, wait_for
from pdxfer.common.secret_file import read_secret_file


@dataclass
class LocalMaster:
    """A pdxfer-master child process started by :func:`start_local_master`."""

    proc: ManagedProcess
    host: str
    port: int
    http_port: int
    workdir: str
    log_path: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM (the master steps down and exits), SIGKILL after ``timeout_s``; the exit status."""
        return self.proc.stop(timeout_s)

    def kill(self) -> None:
        """SIGKILL now: no goodbye (an HA leader's lease has to run out)."""
        self.proc.kill()


def _write_secret(path: str, secret: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def _answers(address: str, token: str | None) -> bool:
    try:
        with MasterClient(address, token=token, timeout_s=1.0) as c:
            c.ping()
        return True
    except MasterError:
        return False


def start_local_master(
    host: str = "127.0.0.1",
    token: str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 30.0,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    token_file: str | Path | None = None,
    log_name: str | None = None,
    die_with_parent: bool = False,
) -> LocalMaster:
    """Start ``pdxfer-master`` on ``host`` with OS-chosen ports (``extra_args`` may name others);
    returns once it answers. RuntimeError with its log if it exits, TimeoutError after ``timeout_s``.

    token / token_file: the shared secret (written to a private file), or a file holding it.
    workdir: where the port file and the log go (a fresh temporary folder by default).
    log_name: the log's file name in workdir (default: unique per start).
    env: variables added to this process's environment for the child.
    die_with_parent: the master gets SIGTERM if this process dies (call from the main thread only).
    """
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    workdir = str(workdir or tempfile.mkdtemp(prefix="pdxfer-master-"))
    os.makedirs(workdir, exist_ok=True)
    stem = os.path.join(workdir, f"master-{os.getpid()}-{random.getrandbits(32):08x}")
    port_file = stem + ".port"
    cmd = [sys.executable, "-m", "pdxfer.master.service", "--host", host, "--port", "0", "--port-file", port_file]
    if token is not None:
        token_file = stem + ".token"
        _write_secret(str(token_file), token)
    elif token_file is not None:
        token = read_secret_file(token_file, "token file")
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    cmd += list(extra_args)  # later flags win: "--port N" here fixes the port
    log_path = os.path.join(workdir, log_name) if log_name else stem + ".log"
    proc = ManagedProcess(cmd, log_path, env=python_env(env), name="pdxfer-master",
                          die_with_parent=die_with_parent)
    deadline = time.monotonic() + timeout_s
    try:
        ports = wait_for(lambda: read_port_file(port_file), timeout_s, "pdxfer-master port file", proc)
        master = LocalMaster(proc, host, ports[0], ports[1], workdir, log_path)
        wait_for(lambda: _answers(master.address, token), max(0.1, deadline - time.monotonic()),
                 f"answer from pdxfer-master at {master.address}", proc)
        return master
    except BaseException:
        proc.kill()
        raise
