"""The rdma tier: soft-RoCE inside a QEMU guest (tools/softroce), booted once per pytest session.

Two kinds of modules live here:
* ``test_*.py`` run on the host; their guest commands run in the session's one guest
  (:class:`GuestSession`).
* ``guest_*.py`` run inside the guest, where rxe0 (192.168.77.1) and rxe1 (192.168.77.2) exist.
  On the host they are collected too, each test as a :class:`GuestCase`: the first one to run
  boots the guest and starts one pytest run there of every guest test the host selected; each
  GuestCase then passes, fails or skips with what its own test did in the guest (the guest's
  traceback and captured output in its report), as soon as the guest reports it.

In the guest, the reader (this pytest process) owns rxe0 and every holder process owns rxe1, so
each READ crosses the veth pair between two RDMA devices.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_GUEST = os.environ.get("PDXFER_SOFTROCE") == "1"
# The host test passes how long speed_loop_s() took on the host just before the boot.
HOST_LOOP_ENV = "PDXFER_HOST_LOOP_S"
READER_DEV = os.environ.get("SOFTROCE_DEV0", "rxe0")
HOLDER_DEV = os.environ.get("SOFTROCE_DEV1", "rxe1")
# UCX transports that would mean the bytes did not cross an RDMA device.
NOT_RDMA = ("tcp", "cma", "sysv", "posix", "xpmem", "knem")

if IN_GUEST:
    # NIXL's UCX must see the ib module (the host-only UCX_MODULES=^ib default would hide rxe).
    os.environ["UCX_MODULES"] = "all"
    os.environ.setdefault("UCX_TLS", "rc_verbs,ud_verbs,self")
    os.environ["UCX_NET_DEVICES"] = f"{READER_DEV}:1"
    # A dead holder's QPs are gone and rxe (like RoCE NICs) drops packets for them silently: the
    # reader learns of the death only when its RC retries run out, after (retries + 1) x timeout.
    # The same sum is how long a live holder may go unheard before it is declared dead, so it is
    # set well above a network stall (test_live_holder_survives_a_network_stall) and well below
    # the guest's death bound. 200 ms x 3 declared a live holder dead in a loaded CI guest;
    # these: a dead one noticed ~8 s after the kill, a live one kept through a 2 s stall (docs/softroce.md).
    os.environ.setdefault("UCX_RC_TIMEOUT", "1s")
    os.environ.setdefault("UCX_RC_RETRY_COUNT", "6")

HOLDER_PREFIX = ["env", f"UCX_NET_DEVICES={HOLDER_DEV}:1"]


def speed_loop_s() -> float:
    """Seconds a fixed pure-Python loop takes here (best of 3): the guest compares its own with the
    host's to learn how much slower it runs."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        acc = 0
        for i in range(300_000):
            acc = (acc + i * i) % 1_000_003
        best = min(best, time.perf_counter() - t0)
    return best


def _guest_slowdown() -> float:
    """How many times slower than the host this guest runs right now (at least 1). QEMU TCG
    emulates the CPU, and on a loaded host the guest gets a share of it: the suite's bounds, written
    for the host, are scaled by this, so a slow but correct guest does not fail on a fixed number
    (a 128 MiB READ over rxe took over 20 s with the host's load average at 12)."""
    host = float(os.environ.get(HOST_LOOP_ENV) or 0)
    if host <= 0:
        return 10.0  # run by hand without the host's figure: TCG alone costs about that
    return max(1.0, speed_loop_s() / host)


SLOWDOWN = _guest_slowdown() if IN_GUEST else 1.0
# The bounds below only stop a hang; each grows with the slowdown, from what one run of the tier
# measured here (2 busy cores, host load 1.4, the guest 10.2x slower than the host): the slowest
# guest test 45 s (the end-to-end case: a master, a torch-importing holder, a read), a NIXL holder
# process started in 10-15 s, the 160 MiB read 7.4 s. The loop measures the CPU only; starting a
# process also reads hundreds of files over 9p, which costs the host's CPU as well (a
# torch-importing holder took over 180 s at load average 12), hence the floors.
GUEST_TEST_TIMEOUT_S = max(300.0, 25 * SLOWDOWN)  # per test: 6.7x the slowest (45 s at 10.2x)
START_S = max(90.0, 6 * SLOWDOWN)  # a helper process (Python + NIXL over 9p) starting: 6-9x its 10-15 s
READ_WAIT_S = max(120.0, 20 * SLOWDOWN)  # the transport suite's 20 s read bound, in the guest
DEATH_BOUND_S = max(30.0, 10 * SLOWDOWN)  # ... and its 10 s bound on noticing a killed holder

# The host's bounds on the guest tests' one run, from the same measurement: boot to the guest's
# pytest session start took 25 s, the guest's pytest run 211 s (21 s per unit of slowdown; in a
# later run 252 s at 17.5x with two more tests, 14 s per unit).
# Until the guest has said how slow it is (its first report line), the run has GUEST_START_S;
# from then on GUEST_RUN_PER_SLOWDOWN_S for each unit of the slowdown it measured, and never more
# than GUEST_TIER_S in all, whatever the slowdown (the whole suite's budget is 55 minutes).
GUEST_START_S = 180.0  # 7x the 25 s measured
GUEST_RUN_PER_SLOWDOWN_S = 52.0  # 2.5x the 21 s measured: 530 s at 10.2x
GUEST_TIER_S = 20 * 60.0


def guest_run_bound_s(slowdown: float) -> float:
    """How long the guest tests' run may take once the guest has measured its ``slowdown``."""
    return min(GUEST_TIER_S - GUEST_START_S, max(300.0, GUEST_RUN_PER_SLOWDOWN_S * slowdown))


def guest_bound(seconds: float) -> float:
    """A bound chosen by hand for the guest on an idle host, scaled when the guest runs slower."""
    return seconds * max(1.0, SLOWDOWN / 2)


def pytest_report_header(config) -> str | None:
    if IN_GUEST:
        return f"soft-RoCE guest: {SLOWDOWN:.1f}x slower than the host; bounds scaled by that"
    return None


@pytest.fixture(autouse=True)
def _guest_bounds(monkeypatch):
    """In the guest, the transport suite's bounds (written for the host) replaced by the guest's."""
    if IN_GUEST:
        from tests.transport import test_conformance

        monkeypatch.setattr(test_conformance, "WAIT", READ_WAIT_S)
        monkeypatch.setattr(test_conformance, "DEATH_BOUND_S", DEATH_BOUND_S)


def _testbed():
    where = str(REPO / "tools" / "softroce")
    if where not in sys.path:
        sys.path.insert(0, where)
    import testbed

    return testbed


_missing_packages = pytest.StashKey[list]()


def missing_packages(config: pytest.Config) -> list[str]:
    """The testbed's Debian packages, installed (root + apt-get) before the first rdma test that
    needs one, whichever runs first; returns what is still missing. Without this a fresh machine
    failed the host probe test (no pyverbs yet) and passed on the rerun, once the guest test had
    installed them."""
    if _missing_packages not in config.stash:
        testbed = _testbed()
        missing = testbed.missing_packages()
        if missing and os.geteuid() == 0 and shutil.which("apt-get"):
            testbed.ensure_packages(install=True)
            missing = testbed.missing_packages()
        config.stash[_missing_packages] = missing
    return config.stash[_missing_packages]


@pytest.fixture(scope="session")
def softroce_packages(pytestconfig) -> list[str]:
    return missing_packages(pytestconfig)


def guest_unavailable(config: pytest.Config) -> str | None:
    """Why the guest cannot boot here (a skip reason), or None: root, and the packages installed."""
    if os.geteuid() != 0:
        return "the soft-RoCE guest needs root (QEMU, apt-get for its packages)"
    missing = missing_packages(config)
    if missing:
        return f"missing Debian packages {missing} and no apt-get to install them"
    return None


# --- the session's one guest (host side) ------------------------------------------------------

GUEST_MODULES = ("tests/rdma/guest_devices.py", "tests/rdma/guest_conformance.py", "tests/rdma/guest_e2e.py")
# NIXL's bundled libibverbs only searches /usr/lib64/libibverbs for providers and cannot load the
# distribution's rxe provider; preloading the distribution's libibverbs lets UCX's verbs calls
# resolve to a copy that can (docs/softroce.md).
GUEST_PRELUDE = "export LD_PRELOAD=$(ldconfig -p | awk '/libibverbs.so.1 .*x86-64/{print $NF; exit}')"
# The guest's pytest appends one JSON line per test phase here (inside: /run/softroce/...).
REPORT_NAME = "guest-report.jsonl"
REPORT_ENV = "PDXFER_GUEST_REPORT"


class _Tee(io.TextIOBase):
    """The guest's output, kept for the summary test and written to the session's log file."""

    def __init__(self, log) -> None:
        self.log = log
        self.buf = io.StringIO()

    def write(self, text: str) -> int:
        self.buf.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def getvalue(self) -> str:
        return self.buf.getvalue()


class GuestTier:
    """The one pytest run of the selected guest tests in the session's guest, and what it reported."""

    def __init__(self, session: "GuestSession", nodeids: list[str]) -> None:
        g = session.guest()
        self.nodeids = nodeids
        self.report = g.rundir / REPORT_NAME
        self.out = _Tee(session.log)
        self.t0 = time.monotonic()
        # The guest compares its own speed with the host's figure and scales its bounds by the ratio.
        cmd = (f"{GUEST_PRELUDE}\nexport {HOST_LOOP_ENV}={speed_loop_s():.4f} "
               f"{REPORT_ENV}=/run/softroce/{REPORT_NAME}\n"
               f"exec python -m pytest {' '.join(shlex.quote(n) for n in nodeids)} "
               "-v -rA -p no:cacheprovider --durations=10")
        self.cmd = g.start(cmd, timeout=GUEST_START_S, sink=self.out)
        self.phases: dict[str, dict[str, dict]] = {}
        self.slowdown: float | None = None
        self._pos = 0

    def _read(self) -> None:
        try:
            with open(self.report, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._pos += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            rec = json.loads(line)
            if "slowdown" in rec:
                self.slowdown = rec["slowdown"]
                bound = guest_run_bound_s(self.slowdown)
                self.cmd.deadline = time.monotonic() + bound
                self.cmd.timeout = time.monotonic() + bound - self.cmd.started
                self.out.write(f"softroce: the guest is {self.slowdown:.1f}x slower than the host; "
                               f"its tests have {bound:.0f} s from now\n")
            else:
                self.phases.setdefault(rec["nodeid"], {})[rec["when"]] = rec

    def result(self, nodeid: str) -> dict[str, dict] | None:
        """The phases the guest reported for ``nodeid``, once its teardown is in; None when the
        guest run ended without it. Bounded by the guest run's deadline (guest_run_bound_s)."""
        while True:
            self._read()
            if "teardown" in self.phases.get(nodeid, {}):
                return self.phases[nodeid]
            if self.cmd.poll() is not None:
                self._read()
                return self.phases[nodeid] if "teardown" in self.phases.get(nodeid, {}) else None
            time.sleep(POLL_S)

    def finish(self) -> int:
        rc = self.cmd.wait()
        self._read()
        return rc

    def tail(self, n: int = 6000) -> str:
        return self.out.getvalue()[-n:]


# How often the host looks for the guest's next report line (a file growing on the 9p share).
POLL_S = 0.2


class GuestSession:
    """The pytest session's one soft-RoCE guest: booted on first use, every guest command of the
    session run in it one after another (the guest tests' pytest run first, then the host tests'
    own commands). Each boot is logged ("softroce: booting the guest") and counted."""

    def __init__(self, session: pytest.Session) -> None:
        self.session = session
        self.boots = 0
        self.tier: GuestTier | None = None
        self._guest = None
        log_path = _testbed().cache_dir(REPO) / "last-rdma-tier.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.log = open(log_path, "w")

    def guest(self):
        """The running guest, booted now if there is none (or the last one was killed)."""
        if self._guest is None or not self._guest.alive:
            if self._guest is not None:
                self._guest.close()
            self.boots += 1
            self._guest = _testbed().Guest(REPO, Path(sys.prefix), sink=self.log)
        return self._guest

    def tier_run(self) -> GuestTier:
        """The guest tests' run: the GuestCase items this session selected, or, when none was
        selected (the summary test alone), every guest module."""
        if self.tier is None:
            nodeids = [i.nodeid for i in self.session.items if isinstance(i, GuestCase)] or list(GUEST_MODULES)
            self.tier = GuestTier(self, nodeids)
        return self.tier

    def run(self, command: str, timeout: float, sink) -> int:
        """Run a host test's own command in the guest, after the guest tests' run is over."""
        if self.tier is not None:
            self.tier.finish()
        return self.guest().run(command, timeout, sink)

    def close(self) -> None:
        if self._guest is not None:
            self._guest.close(sink=self.log)
        self.log.write(f"softroce: {self.boots} guest boot(s) in this pytest session\n")
        self.log.close()


_guest_session = pytest.StashKey[GuestSession]()


def guest_session(session: pytest.Session) -> GuestSession:
    config = session.config
    if _guest_session not in config.stash:
        config.stash[_guest_session] = GuestSession(session)
    return config.stash[_guest_session]


@pytest.fixture
def guest(request) -> GuestSession:
    """The session's guest, for a host test; skips (a failure in CI) when it cannot boot here."""
    why = guest_unavailable(request.config)
    if why:
        pytest.skip(why)
    return guest_session(request.session)


class GuestFailure(Exception):
    """A guest test failed in the guest; the message is its report from there."""


class GuestCase(pytest.Item):
    """A ``guest_*.py`` test collected on the host: it runs in the session's guest (one run for all
    of them) and passes, fails or skips with what it did there."""

    def runtest(self) -> None:
        why = guest_unavailable(self.config)
        if why:
            pytest.skip(why)
        gs = guest_session(self.session)
        tier = gs.tier_run()
        phases = tier.result(self.nodeid)
        where = f"in the soft-RoCE guest (full output: {gs.log_path})"
        if phases is None:
            rc = tier.cmd.rc
            why_over = (f"ran out of its {tier.cmd.timeout:.0f} s" if rc == 124 else f"ended (rc {rc})")
            raise GuestFailure(f"{self.nodeid}: the guest's pytest run {why_over} before this test reported; "
                               f"{where}, its tail:\n{tier.tail()}")
        for when in ("setup", "call", "teardown"):
            rec = phases.get(when)
            if rec and rec["outcome"] == "failed":
                sections = "".join(f"\n----- {title} -----\n{text}" for title, text in rec.get("sections", []))
                raise GuestFailure(f"{self.nodeid} {when} failed {where}"
                                   f" (guest {tier.slowdown or 0:.1f}x slower than the host):\n"
                                   f"{rec['longrepr']}{sections}")
        for when in ("setup", "call"):
            rec = phases.get(when)
            if rec and rec["outcome"] == "skipped":
                pytest.skip(f"skipped in the guest: {rec.get('longrepr')}")
        if "call" not in phases:
            raise GuestFailure(f"{self.nodeid}: the guest reported no call phase {where}: {phases}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GuestFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, self.name


def _is_guest_module(path: Path) -> bool:
    return path.name.startswith("guest_") and path.suffix == ".py"


def pytest_collect_file(file_path: Path, parent):
    # On the host the guest modules are collected like test modules (pytest names only test_*.py),
    # their tests then replaced by GuestCase items; inside, the host passes them by node id.
    if not IN_GUEST and _is_guest_module(file_path) and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items) -> None:
    for i, item in enumerate(items):
        if not _is_guest_module(Path(str(item.path))):
            continue
        if IN_GUEST:
            item.add_marker(pytest.mark.timeout(GUEST_TEST_TIMEOUT_S))
            continue
        case = GuestCase.from_parent(item.parent, name=item.name)
        # Plain markers only, for -m: whether it skips, and how long it may take, is the guest's.
        for mark in item.own_markers:
            if mark.name not in ("parametrize", "usefixtures", "skip", "skipif", "xfail", "timeout"):
                case.add_marker(mark)
        case.add_marker(pytest.mark.rdma)
        # The first one waits for the boot and the guest's collection; any one at most for the
        # guest run's bound (which kills the guest when it runs out).
        case.add_marker(pytest.mark.timeout(GUEST_TIER_S + 60), append=False)
        items[i] = case


# --- the guest side of the reports ----------------------------------------------------------

def _report_line(rec: dict) -> None:
    with open(os.environ[REPORT_ENV], "a") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_sessionstart(session) -> None:
    if IN_GUEST and os.environ.get(REPORT_ENV):
        _report_line({"slowdown": SLOWDOWN})


def pytest_runtest_logreport(report) -> None:
    """In the guest: each phase of each test, for the host's GuestCase of that test."""
    if not (IN_GUEST and os.environ.get(REPORT_ENV)):
        return
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(report.duration, 3)}
    if report.failed:
        rec["longrepr"] = str(report.longrepr)
        rec["sections"] = [[title, text] for title, text in report.sections]
    elif report.skipped:
        lr = report.longrepr
        rec["longrepr"] = str(lr[2]).removeprefix("Skipped: ") if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    _report_line(rec)


_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status.append(int(exitstatus))
    if not IN_GUEST and _guest_session in session.config.stash:
        session.config.stash[_guest_session].close()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not IN_GUEST and _guest_session in config.stash:
        gs = config.stash[_guest_session]
        terminalreporter.write_line(f"soft-RoCE guest: {gs.boots} boot(s) in this session; its output in {gs.log_path}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    # With UCX's ib module loaded, every process that created a UCX context segfaults in a library
    # destructor at exit (rc 139; measured in the guest with and without the system libnl preloaded).
    # All reports are written by now; leave before the destructors run so the status is pytest's.
    if IN_GUEST and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def ucx_lane_lines(text: str) -> list[str]:
    """Endpoint configuration lines ('self/intra-node/inter-node cfg#N rma(...) ...') that UCX logs
    at UCX_LOG_LEVEL=info."""
    return [ln.split("UCX  INFO", 1)[-1].strip() for ln in text.splitlines()
            if re.search(r"(self|inter-node|intra-node) cfg#\d+", ln)]
