"""Fixtures for the transport conformance suite: real holder/reader processes, bounded waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pdxfer.transport import KINDS, create_transport, kind_spec, unavailable_reason
from pdxfer.transport import transport_options as registry_options
from pdxfer.transport.base import RegisteredRegion, Transport
from pdxfer.transport.nixl.env import apply_ucx_env, prepare_ucx_env
from tests.proc_lines import read_prefixed_line

prepare_ucx_env()  # before NIXL/UCX loads anywhere in this process

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
# Region 0 fits 4096 distinct 32 KiB blocks with room to shuffle; region 1 is small and odd-sized.
HOLDER_SIZES = (160 * MiB, MiB + 12345)


def transport_options(kind: str, host: str | None = None) -> dict:
    return registry_options(kind, listen_host=host or "127.0.0.1")


def _opt_args(opts: dict) -> list[str]:
    out = []
    for k, v in opts.items():
        out += ["--opt", f"{k}={v}"]
    return out


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return apply_ucx_env(env)


def read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """Next stdout line of ``proc`` starting with ``prefix``, or fail after ``timeout`` seconds."""
    return read_prefixed_line(proc, prefix, timeout)


def stop(proc: subprocess.Popen) -> None:
    """Kill a child we started and reap it (bounded)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


@dataclass
class Holder:
    kind: str
    proc: subprocess.Popen
    meta: bytes
    sizes: tuple[int, ...] = HOLDER_SIZES
    extra: list = field(default_factory=list)
    seed: int = 0  # the pattern seed of its regions


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP a holder and return once it is really stopped: the stop lands asynchronously, and on
    a loaded box the holder may otherwise still serve a read posted right after the signal."""
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped(pid, timeout)


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def spawn(args: list[str], prefix_cmd: list[str] | None = None) -> subprocess.Popen:
    cmd = (prefix_cmd or []) + [sys.executable, "-m", "tests.transport.peer_proc", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=child_env())


def start_holder(kind: str, sizes: tuple[int, ...] = HOLDER_SIZES, opts: dict | None = None,
                 prefix_cmd: list[str] | None = None, timeout: float = 60.0, seed: int = 0) -> Holder:
    """A holder process serving ``sizes`` regions of :func:`pdxfer.probe.pattern.pattern` with
    ``seed``; tests with two holders give each its own seed, so bytes from the wrong one show."""
    opts = transport_options(kind) if opts is None else opts
    proc = spawn(["hold", "--kind", kind, "--sizes", ",".join(map(str, sizes)), "--seed", str(seed),
                  *_opt_args(opts)], prefix_cmd)
    try:
        line = read_line(proc, "META ", timeout)
    except BaseException:
        stop(proc)
        raise
    return Holder(kind, proc, bytes.fromhex(line.split()[1]), sizes, seed=seed)


def spawn_reader(kind: str, holder: Holder, block: int, batch: int, seed: int = 1, loop: bool = False,
                 iters: int = 1, opts: dict | None = None, prefix_cmd: list[str] | None = None) -> subprocess.Popen:
    opts = transport_options(kind) if opts is None else opts
    args = ["read", "--kind", kind, "--meta", holder.meta.hex(), "--remote-size", str(holder.sizes[0]),
            "--block", str(block), "--batch", str(batch), "--seed", str(seed), "--iters", str(iters),
            "--pattern-seed", str(holder.seed),
            *_opt_args(opts)]
    if loop:
        args.append("--loop")
    return spawn(args, prefix_cmd)


class Reader:
    """This process's side: a transport with one registered destination region plus guard bytes."""

    GUARD = 4096

    def __init__(self, kind: str, size: int = HOLDER_SIZES[0]) -> None:
        self.kind = kind
        self.raw = np.full(size + 2 * self.GUARD, 0xA5, dtype=np.uint8)
        self.dst = self.raw[self.GUARD:self.GUARD + size]
        self.t: Transport = create_transport(kind, **transport_options(kind))
        self.t.register([RegisteredRegion(0, self.dst.ctypes.data, self.dst.nbytes)])

    def guards_intact(self) -> bool:
        return bool((self.raw[:self.GUARD] == 0xA5).all() and (self.raw[-self.GUARD:] == 0xA5).all())

    def close(self) -> None:
        self.t.close()


def kind_params() -> list:
    return [pytest.param(k, marks=[getattr(pytest.mark, m) for m in [kind_spec(k).test_marker] if m])
            for k in KINDS]


@pytest.fixture(params=kind_params())
def kind(request) -> str:
    reason = unavailable_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


# What makes a frozen holder unable to finish a read, per kind. pdxfer's TCP holder serves every
# byte itself. UCX's shared-memory and CMA lanes copy a frozen process's memory without it (a
# 160 MiB NIXL READ from a SIGSTOPped holder completes here), so the tests that need a read held in
# flight pin UCX to TCP, whose READs the holder's own progress serves. UCX reads the variable
# when each context is created: this process's readers and the holder's command both get it.
HOLD_READS_ENV: dict[str, dict[str, str]] = {"tcp": {}, "nixl": {"UCX_TLS": "tcp"}}


@pytest.fixture
def freeze_holds_reads(kind, monkeypatch) -> list[str] | None:
    """Set up this process so that a frozen holder cannot finish a read of ``kind``; returns the
    command prefix for the holder (pass it as ``prefix_cmd``). A suite where no setting does it
    (one-sided RDMA, served without the holder's CPU) overrides this fixture to return None."""
    if kind not in HOLD_READS_ENV:
        pytest.fail(f"tests/transport/conftest.py HOLD_READS_ENV does not say how a frozen {kind} holder "
                    f"is kept from finishing a read")
    env = HOLD_READS_ENV[kind]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ["env", *(f"{k}={v}" for k, v in env.items())]


@pytest.fixture
def holder_factory():
    """Start holders on demand; every one is killed and reaped at teardown, even on failure."""
    made: list[Holder] = []

    def make(kind: str, **kw) -> Holder:
        h = start_holder(kind, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        stop(h.proc)


@pytest.fixture
def procs():
    """Child processes a test starts; all killed and reaped at teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        stop(p)


@pytest.fixture
def reader_factory():
    made: list[Reader] = []

    def make(kind: str, size: int = HOLDER_SIZES[0]) -> Reader:
        r = Reader(kind, size)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


class SharedPeers:
    """One long-lived holder process and one reader per kind, for the read-only tests of a module."""

    def __init__(self, holder_kwargs: dict | None = None, connect_timeout: float = 10.0) -> None:
        self._holders: dict[str, Holder] = {}
        self._readers: dict[str, Reader] = {}
        self._holder_kwargs = holder_kwargs or {}
        self._connect_timeout = connect_timeout

    def holder(self, kind: str) -> Holder:
        if kind not in self._holders:
            self._holders[kind] = start_holder(kind, **self._holder_kwargs)
        return self._holders[kind]

    def reader(self, kind: str) -> tuple[Reader, str]:
        if kind not in self._readers:
            self._readers[kind] = Reader(kind)
        r = self._readers[kind]
        return r, r.t.connect(self.holder(kind).meta, timeout=self._connect_timeout)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        for h in self._holders.values():
            stop(h.proc)


@pytest.fixture(scope="module")
def shared():
    peers = SharedPeers()
    yield peers
    peers.close()
