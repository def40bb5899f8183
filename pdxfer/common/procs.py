"""Child processes that never outlive their owner: start one in its own process group with its
output in a log file, wait (always with a bound) for it to write a port file or answer, and stop
it with SIGTERM then SIGKILL.

Used by everything that starts pdxfer's own processes (the master starter, the local etcd, the
launcher, tests and benchmarks), so that stopping a process means one thing everywhere: its whole
group is gone, grandchildren included. Also where such processes keep logs and caches by default
(`default_run_dir`) and the environment a Python child needs to import this pdxfer (`python_env`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

# The checkout (or site-packages folder) this pdxfer was imported from.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def close_stdin_and_reap(proc: subprocess.Popen, grace_s: float, kill_wait_s: float = 5.0) -> None:
    """End a child that exits once its stdin closes: close it, wait ``grace_s``, kill it if it
    hangs, and close its pipes (bounded: at most ``grace_s + kill_wait_s``)."""
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait_s)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just reported free (bind to port 0, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a Python child that must import the same pdxfer as we do,
    even when pdxfer is not installed (a checkout), with unbuffered output so logs are current."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def default_run_dir() -> Path:
    """Where logs and caches of started processes go when the caller does not say: `.pdxfer-run/`
    in the checkout, or in the current directory when pdxfer is installed from a wheel (no
    checkout around it)."""
    root = Path(PACKAGE_ROOT)
    if (root / "pyproject.toml").exists():
        return root / ".pdxfer-run"
    return Path.cwd() / ".pdxfer-run"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies, even by SIGKILL (Linux).

    The kernel sends it when the *thread* that forked exits, so use it only from a main thread.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ManagedProcess:
    """A child process in its own process group, with its output in a log file.

    stop() sends SIGTERM to the whole group, waits up to `timeout`, then SIGKILLs the group, so
    grandchildren (vLLM's engine core, its workers) never outlive it.
    """

    def __init__(self, argv: Sequence[str], log_path: str | Path, env: Mapping[str, str] | None = None,
                 name: str | None = None, cwd: str | Path | None = None,
                 die_with_parent: bool = False) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.name = name or Path(self.argv[0]).name
        self._env, self._cwd, self._die_with_parent = (dict(env) if env is not None else None), cwd, die_with_parent
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(self.log_path, "ab")
        try:
            self._popen = subprocess.Popen(
                self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        except BaseException:
            self._log.close()
            raise
        self.pid = self._popen.pid

    def respawn(self, argv: Sequence[str] | None = None) -> "ManagedProcess":
        """The same process started again (``argv`` replaces its command line): same environment,
        folder and name; its output continues the same log. This one must have exited."""
        if self.alive():
            raise RuntimeError(f"{self.name} (pid {self.pid}) still runs: stop it before starting it again")
        self.kill()  # reap and close our log handle; nothing of the old group may linger
        return ManagedProcess(argv if argv is not None else self.argv, self.log_path, env=self._env,
                              name=self.name, cwd=self._cwd, die_with_parent=self._die_with_parent)

    def alive(self) -> bool:
        return self._popen.poll() is None

    def poll(self) -> int | None:
        """Like ``Popen.poll``: the exit status, or None while the leader runs."""
        return self._popen.poll()

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self, timeout: float = 15) -> int | None:
        """SIGTERM the group, wait up to `timeout` s for the leader and its group, then SIGKILL.
        Returns the leader's exit status."""
        if self.alive() or self._group_alive():
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self._popen.poll()
                if not self.alive() and not self._group_alive():
                    break
                time.sleep(0.05)
        self.kill()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the whole group now and reap the leader (bounded)."""
        # Only while something of ours is left: once the group is empty its number may be reused.
        if self.alive() or self._group_alive():
            self._signal_group(signal.SIGKILL)
        try:
            self._popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed child always exits
            pass
        if not self._log.closed:
            self._log.close()

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_note(self) -> str:
        """'log PATH ends with:' and the log's tail, for an error message about this process."""
        return f"log {self.log_path} ends with:\n{self.log_tail()}"

    def exit_note(self, when: str) -> str:
        """'NAME (pid N) exited with RC WHEN; log PATH ends with: ...' for a process that died
        while someone waited for it."""
        return f"{self.name} (pid {self.pid}) exited with {self.returncode} {when}; {self.log_note()}"

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, log={str(self.log_path)!r})"


def wait_for(check: Callable[[], T | None], timeout: float, what: str, proc: ManagedProcess | None = None,
             interval: float = 0.05) -> T:
    """Call ``check`` until it returns something other than None (or False) and return that.

    Raises RuntimeError with the log tail as soon as ``proc`` exits, TimeoutError (naming ``what``
    and the log tail) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None and got is not False:
            return got
        if proc is not None and not proc.alive():
            raise RuntimeError(proc.exit_note(f"before {what}"))
        if time.monotonic() >= deadline:
            tail = f"; {proc.log_note()}" if proc is not None else ""
            raise TimeoutError(f"no {what} after {timeout:.1f} s{tail}")
        time.sleep(interval)


def read_port_file(path: str | Path) -> list[int] | None:
    """The ports a child wrote (whitespace-separated), or None while the file is absent or empty.

    Children write port files atomically (``os.replace``), so a non-empty file is complete.
    """
    try:
        text = Path(path).read_text().split()
    except FileNotFoundError:
        return None
    if not text:
        return None
    try:
        return [int(t) for t in text]
    except ValueError:
        raise RuntimeError(f"port file {path} holds {' '.join(text)[:80]!r}, not port numbers") from None


def wait_port_file(path: str | Path, timeout: float, proc: ManagedProcess | None = None) -> list[int]:
    """Wait (bounded) until ``proc`` has written its port file; the ports in it."""
    return wait_for(lambda: read_port_file(path), timeout, f"port file {path}", proc)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when ``url`` answers 200 within ``timeout``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http_ready(url: str, timeout: float, proc: ManagedProcess | None = None,
                    interval: float = 0.5) -> None:
    """Poll `url` until it answers 200; raise RuntimeError with the log tail if `proc` dies or
    TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_err = "no answer yet"
    while True:
        if proc is not None and not proc.alive():
            raise RuntimeError(proc.exit_note(f"before {url} was ready"))
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, max(0.1, interval * 4))) as r:
                if r.status == 200:
                    return
                last_err = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last_err = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last_err = str(getattr(e, "reason", e))
        if time.monotonic() >= deadline:
            tail = f"; {proc.log_note()}" if proc else ""
            raise TimeoutError(f"{url} not ready after {timeout:.0f} s ({last_err}){tail}")
        time.sleep(interval)
