"""Soft-RoCE testbed: run a command inside a QEMU (TCG) guest that has two rxe devices.

    tools/softroce/run.sh [--repo DIR] [--venv DIR] [--timeout S] [--mem MiB] [--no-install] -- CMD...
    tools/softroce/run.sh --install-only     (what scripts/setup.sh runs: the packages, nothing else)

Installs the Debian packages it needs (when root and apt exists), builds and caches the guest
(kernel package + busybox initramfs, under <repo>/.pdxfer-run/softroce or $PDXFER_SOFTROCE_CACHE),
boots it with the host root shared read-only over 9p, creates rxe0/rxe1 on a veth pair inside the
guest (192.168.77.1/.2, guest-only), runs CMD in the repository with the venv's bin first on PATH,
streams its output, and exits with its status. The guest is always killed on the way out.
From Python, :class:`Guest` keeps one boot for several commands run one after another (the rdma
test tier boots once per pytest session that way); :func:`run_in_guest` is one boot, one command.

Exit statuses besides the command's: 120 guest set-up failed, 124 timeout, 125 testbed error.
Stdlib only: it runs with the system python3, before any venv exists.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import guest

# Debian package -> a file it provides that proves it is installed.
PACKAGES = {
    "qemu-system-x86": "/usr/bin/qemu-system-x86_64",
    "linux-image-amd64": None,  # checked through guest.find_kernel()
    "busybox-static": None,  # checked through guest.static_busybox()
    "rdma-core": "/usr/sbin/rdma-ndd",
    "iproute2": "/usr/sbin/ip",
    "kmod": "/usr/bin/kmod",
    "ibverbs-utils": "/usr/bin/ibv_devices",
    "ibverbs-providers": "/etc/libibverbs.d/rxe.driver",
    "perftest": "/usr/bin/ib_read_bw",
    "python3-pyverbs": "/usr/lib/python3/dist-packages/pyverbs",
    "ucx-utils": "/usr/bin/ucx_perftest",  # also ucx_info; bench/softroce.py runs ucx_perftest
}
APT_TIMEOUT = 900.0


class TestbedError(RuntimeError):
    """Something the testbed needs is missing or broke; the message says what."""


def missing_packages() -> list[str]:
    out = []
    for pkg, path in PACKAGES.items():
        if pkg == "linux-image-amd64":
            ok = guest.find_kernel() is not None
        elif pkg == "busybox-static":
            ok = guest.static_busybox() is not None
        else:
            ok = path is not None and os.path.exists(path)
        if not ok:
            out.append(pkg)
    return out


def ensure_packages(install: bool) -> None:
    """Install what is missing with apt (idempotent: nothing happens when all is there)."""
    missing = missing_packages()
    if not missing:
        return
    if not install:
        raise TestbedError(f"missing Debian packages: {' '.join(missing)} (run as root without --no-install)")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise TestbedError(f"missing Debian packages: {' '.join(missing)}; installing needs root and apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"softroce: installing {' '.join(missing)}", file=sys.stderr, flush=True)
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(f"{' '.join(cmd)} did not finish within {APT_TIMEOUT:.0f} s") from exc
        if res.returncode != 0:
            raise TestbedError(f"{' '.join(cmd)} failed (rc {res.returncode}): {res.stderr[-2000:]}")
    still = missing_packages()
    if still:
        raise TestbedError(f"still missing after apt-get install: {' '.join(still)}")


def cache_dir(repo: Path) -> Path:
    env = os.environ.get("PDXFER_SOFTROCE_CACHE")
    return Path(env) if env else repo / ".pdxfer-run" / "softroce"


def _die_with_runner() -> None:
    """In the qemu child: SIGKILL when the runner dies (a killed runner must not leave a guest)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill qemu's whole process group and reap it (bounded)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, pos: int, sink) -> int:
    """Copy what was appended to ``path`` since ``pos`` to ``sink``; returns the new position."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except FileNotFoundError:
        return pos
    if data:
        sink.write(data.decode(errors="replace"))
        sink.flush()
    return pos + len(data)


class GuestCommand:
    """One command running in a :class:`Guest`; ``poll`` / ``wait`` give its exit status."""

    def __init__(self, guest: "Guest", n: int, timeout: float, sink) -> None:
        self.guest, self.n, self.timeout, self.sink = guest, n, timeout, sink
        self.started = time.monotonic()
        # The caller may move it (and ``timeout`` with it) once it knows more about the command.
        self.deadline = self.started + timeout
        self.rc: int | None = None
        self._pos = 0

    def poll(self) -> int | None:
        """Copy new output to the sink; the exit status once the command is over, else None.

        A command still running at its deadline kills the whole guest (124): a guest-side timeout
        could not stop a hung guest, and the session is over after that.
        """
        if self.rc is not None:
            return self.rc
        g = self.guest
        self._pos = _tail(g.rundir / f"out.{self.n}", self._pos, self.sink)
        rc_file = g.rundir / f"rc.{self.n}"
        if rc_file.exists():
            self._pos = _tail(g.rundir / f"out.{self.n}", self._pos, self.sink)
            self.rc = int(rc_file.read_text().strip() or 125)
        elif g.proc.poll() is not None:
            self._pos = _tail(g.rundir / f"out.{self.n}", self._pos, self.sink)
            self.rc = g._stopped(self.sink)
        elif time.monotonic() > self.deadline:
            self.sink.write(f"\nsoftroce: guest still running after {self.timeout:.0f} s; killing it\n")
            g._kill(self.sink)
            self.rc = 124
        if self.rc is not None:
            g._current = None
        return self.rc

    def wait(self) -> int:
        """Block until the command is over (bounded by its own timeout)."""
        while self.poll() is None:
            time.sleep(POLL_S)
        assert self.rc is not None
        return self.rc


# How often the host looks at the guest's results share: a file appearing there is the only
# event 9p offers (no inotify across it); a tenth of a second is nothing next to a guest command.
POLL_S = 0.1


class Guest:
    """A booted guest that runs commands one after another, all in one boot.

    The host writes ``cmd.N`` into the run directory; the guest (guest_setup.sh) runs it there
    with its output in ``out.N`` and its exit status in ``rc.N``. ``close`` (or leaving the
    ``with`` block) kills the guest; a command past its timeout kills it too.
    """

    def __init__(self, repo: Path, venv: Path | None = None, mem_mib: int = 3072, cpus: int = 2, mtu: int = 9000,
                 install: bool = True, sink=sys.stdout, keep: bool = False) -> None:
        ensure_packages(install)
        kernel = guest.find_kernel()
        busybox = guest.static_busybox()
        if kernel is None or busybox is None:
            raise TestbedError("no kernel with rdma_rxe in /boot + /lib/modules (apt-get install linux-image-amd64), "
                               "or no static busybox (apt-get install busybox-static)")
        cache = cache_dir(repo)
        initrd = guest.build_initramfs(kernel, busybox, cache)
        cache.mkdir(parents=True, exist_ok=True)
        self.rundir = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
        self.keep = keep
        self.path = f"{venv}/bin:" if venv else ""
        self._n = 0
        self._current: GuestCommand | None = None
        self._killed = False
        guest.copy_setup_script(HERE / "guest_setup.sh", self.rundir)
        env_lines = {
            "SOFTROCE_CWD": str(repo),
            "SOFTROCE_MTU": str(mtu),
            "SOFTROCE_VENV": str(venv or ""),
            "SOFTROCE_REPO": str(repo),
        }
        needed = [repo] + ([venv, (venv / "bin" / "python").resolve().parent.parent] if venv else [])
        (self.rundir / "binds").write_text("".join(f"{b}\n" for b in guest.binds_for(needed)))
        (self.rundir / "env").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env_lines.items()))
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-smp", str(cpus), "-m", str(mem_mib),
            "-cpu", "max", "-kernel", str(kernel.vmlinuz), "-initrd", str(initrd),
            "-append", "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off",
            "-display", "none", "-monitor", "none", "-serial", f"file:{self.rundir}/console.log",
            "-nic", "none", "-no-reboot",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={self.rundir},mount_tag=xfer,security_model=none",
        ]
        # Counted by the rdma tier (one boot per pytest session): keep the wording.
        sink.write(f"softroce: booting the guest (run directory {self.rundir})\n")
        sink.flush()
        self.t0 = time.monotonic()
        with open(self.rundir / "qemu.log", "wb") as qlog:  # a file, not a pipe: nothing can block qemu
            self.proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_runner)

    @property
    def alive(self) -> bool:
        return not self._killed and self.proc.poll() is None

    def start(self, command: str, timeout: float, sink=sys.stdout) -> GuestCommand:
        """Hand ``command`` (a shell string, run in the repository) to the guest. ``timeout`` counts
        from now, so the first command's includes the boot."""
        if self._current is not None:
            raise TestbedError(f"the guest is still running command {self._current.n}")
        if not self.alive:
            raise TestbedError(f"the guest is gone (run directory {self.rundir})")
        self._n += 1
        tmp = self.rundir / f"cmd.{self._n}.tmp"
        tmp.write_text(f"export PATH={shlex.quote(self.path)}\"$PATH\"\n{command}\n")
        os.replace(tmp, self.rundir / f"cmd.{self._n}")  # the guest must never see half a command
        self._current = GuestCommand(self, self._n, timeout, sink)
        return self._current

    def run(self, command: str, timeout: float, sink=sys.stdout) -> int:
        """Run ``command`` in the guest and return its exit status (124: its time ran out and the
        guest was killed; 120: the guest's set-up failed; 125: the guest stopped without a result)."""
        return self.start(command, timeout, sink).wait()

    def _stopped(self, sink) -> int:
        """The guest powered off by itself: its set-up failed (120) or it broke (125)."""
        self._killed = True
        qemu_out = (self.rundir / "qemu.log").read_text(errors="replace")
        setup_rc = self.rundir / "rc"
        if setup_rc.exists() and setup_rc.read_text().strip() == "120":
            _report_boot(self.rundir, sink)
            return 120
        sink.write(f"\nsoftroce: the guest stopped without a result (qemu rc {self.proc.returncode}) "
                   f"{qemu_out[-2000:]}\n")
        _report_boot(self.rundir, sink)
        return 125

    def _kill(self, sink) -> None:
        self._killed = True
        _kill_group(self.proc)
        _report_boot(self.rundir, sink)

    def close(self, sink=None) -> None:
        """Kill the guest (nothing in it needs a clean power-off: the results share is written
        synchronously); the run directory goes unless kept or the guest failed."""
        failed = self._killed
        _kill_group(self.proc)
        self._killed = True
        if sink is not None:
            sink.write(f"softroce: guest closed after {time.monotonic() - self.t0:.1f} s, {self._n} command(s)\n")
        if not (self.keep or failed):
            shutil.rmtree(self.rundir, ignore_errors=True)

    def __enter__(self) -> "Guest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_in_guest(command: str, repo: Path, venv: Path | None = None, timeout: float = 900.0,
                 mem_mib: int = 3072, cpus: int = 2, mtu: int = 9000, install: bool = True,
                 sink=sys.stdout, keep: bool = False) -> int:
    """Boot the guest, run ``command`` (a shell string) in ``repo`` inside it; its exit status.

    ``timeout`` bounds the whole guest life, boot included.
    """
    g = Guest(repo, venv, mem_mib, cpus, mtu, install, sink, keep)
    try:
        rc = g.run(command, timeout, sink)
        if rc not in (120, 124, 125):
            sink.write(f"softroce: guest finished in {time.monotonic() - g.t0:.1f} s, command rc {rc}\n")
    finally:
        g.close()
    return rc


def _report_boot(rundir: Path, sink) -> None:
    for name in ("qemu.log", "setup.log", "console.log"):
        p = rundir / name
        if p.exists():
            sink.write(f"--- softroce {name} (last 3000 chars) ---\n{p.read_text(errors='replace')[-3000:]}\n")
    sink.write(f"softroce: run directory kept: {rundir}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="softroce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.environ.get("PDXFER_REPO", os.getcwd()),
                    help="repository root; the command runs there inside the guest")
    ap.add_argument("--venv", default=os.environ.get("PDXFER_VENV"),
                    help="virtual environment whose bin/ goes first on PATH (default <repo>/.venv if present)")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on the whole guest life, seconds")
    ap.add_argument("--mem", type=int, default=3072, help="guest memory, MiB")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--mtu", type=int, default=9000, help="veth MTU (rxe's active MTU follows: 9000 -> 4096)")
    ap.add_argument("--no-install", action="store_true", help="never call apt-get; fail if something is missing")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs) on success too")
    ap.add_argument("--install-only", action="store_true",
                    help="install the Debian packages the testbed needs (root, apt-get), then exit")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="command to run inside (after --)")
    a = ap.parse_args(argv)
    if a.install_only:
        try:
            ensure_packages(install=True)
        except TestbedError as exc:
            print(f"softroce: {exc}", file=sys.stderr)
            return 125
        return 0
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given (tools/softroce/run.sh -- CMD ...)")
    repo = Path(a.repo).resolve()
    venv = Path(a.venv).resolve() if a.venv else (repo / ".venv" if (repo / ".venv" / "bin").is_dir() else None)
    command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    try:
        return run_in_guest(command, repo, venv, a.timeout, a.mem, a.cpus, a.mtu, not a.no_install, keep=a.keep)
    except TestbedError as exc:
        print(f"softroce: {exc}", file=sys.stderr)
        return 125


if __name__ == "__main__":
    sys.exit(main())
