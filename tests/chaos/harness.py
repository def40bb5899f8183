"""Run one chaos history: start the cluster, let holders and readers work while a fault injector
(on the main thread: every restart forks from it, see cluster.py) kills, freezes and restarts
things, then stop the faults, wait for the holders to be back, give the readers a recovery
window, stop them, wait the quiet period, take the master's stats and the processes' final
reports, and hand the logs to the checker. Each phase ends on an event in the processes' logs
(tests/chaos/progress.py), within a bound.

  run(ChaosConfig(...), until=...) -> report dict (checker.check's result plus timings)
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

from tests.chaos import checker
from tests.chaos.cluster import ChaosProc, Cluster, MasterSlot
from tests.chaos.common import ChaosConfig, OpLog
from tests.chaos.progress import Progress

# Fault kinds the harness injects itself; ``lock_expire`` is done by the readers (short TTLs,
# sleeping past the TTL) and counted from their logs.
BASE_FAULTS = ["holder_kill", "holder_freeze", "master_kill", "master_freeze", "link_cut", "link_delay"]
HA_FAULTS = ["etcd_kill", "etcd_freeze"]
# Known to break today's master (issue 9 hole 2): only injected when asked for.
OPT_IN_FAULTS = ["node_id_clash"]
DUP_START_BOUND_S = 30.0  # a clash whose second process has not registered by then ends unmet


def fault_kinds(cfg: ChaosConfig) -> list[str]:
    if cfg.faults:
        return list(cfg.faults)
    return BASE_FAULTS + (HA_FAULTS if cfg.ha else [])


class Injector:
    """Faults one after another (random gaps), kinds round-robin in a shuffled order so every kind
    is hit; the undo of each fault (SIGCONT, restart, lift) is a timed event on the same loop."""

    def __init__(self, cl: Cluster, log: OpLog, rng: random.Random, progress: Progress | None = None) -> None:
        self.cl, self.log, self.rng = cl, log, rng
        self.progress = progress  # for a scripted scenario that waits on what the processes logged
        self.dup_killed_at = -1e9  # monotonic: when a clash's second process was last killed
        self.kinds = fault_kinds(cl.cfg)
        self.order: list[str] = []
        self.events: list[tuple[float, int, str, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.counts: dict[str, int] = {}
        self.busy: set[str] = set()  # targets with a fault in progress
        self.flushing = False  # run_due(flush=True): every undo runs now, nothing waits

    def later(self, delay: float, what: str, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (time.monotonic() + delay, next(self.seq), what, fn))

    def run_due(self, flush: bool = False) -> None:
        self.flushing = self.flushing or flush
        while self.events and (flush or self.events[0][0] <= time.monotonic()):
            _, _, what, fn = heapq.heappop(self.events)
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failed restart is logged and retried, never fatal
                self.log.write("fault_error", what=what, err=repr(exc)[:300])
                if not flush:
                    self.later(0.5, what, fn)

    def inject(self) -> None:
        # A kind whose target is busy goes back to the front of the order: in a short run every
        # kind must still be met (the runs assert it), not lose its turn to a busy proxy.
        skipped: list[str] = []
        try:
            for _ in range(len(self.kinds)):
                if not self.order:
                    self.order = self.rng.sample(self.kinds, len(self.kinds))
                kind = self.order.pop()
                if getattr(self, f"_{kind}")():
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                    return
                skipped.append(kind)
        finally:
            self.order.extend(reversed([k for k in skipped if k not in self.order]))

    def _record(self, kind: str, target: str, dur: float, **extra: Any) -> None:
        self.log.write("fault", kind=kind, target=target, t0=time.time(), t1=time.time() + dur, dur=dur, **extra)

    def _pick_holder(self) -> ChaosProc | None:
        ok = [p for p in self.cl.live("holder") if p.name not in self.busy]
        return self.rng.choice(ok) if ok else None

    def _holder_kill(self) -> bool:
        p = self._pick_holder()
        if p is None:
            return False
        p.proc.kill()
        gap = self.rng.uniform(0.1, 1.5)
        self._record("holder_kill", p.name, gap, holder=p.holder)

        def restart() -> None:
            self.cl.start_holder(p.holder)  # same node id, next incarnation
        self.later(gap, f"restart holder {p.holder}", restart)
        return True

    def _holder_freeze(self) -> bool:
        p = self._pick_holder()
        if p is None:
            return False
        dur = self.rng.uniform(0.2, 1.5 * self.cl.cfg.lease_ttl_s)
        self.cl.signal_group(p.proc.pid, signal.SIGSTOP)
        p.frozen = True
        self.busy.add(p.name)
        self._record("holder_freeze", p.name, dur)

        def thaw() -> None:
            self.cl.signal_group(p.proc.pid, signal.SIGCONT)
            p.frozen = False
            self.busy.discard(p.name)
        self.later(dur, f"thaw {p.name}", thaw)
        return True

    def _pick_master(self) -> MasterSlot | None:
        ok = [m for m in self.cl.masters if f"m{m.port}" not in self.busy and m.proc is not None]
        return self.rng.choice(ok) if ok else None

    def _master_kill(self) -> bool:
        m = self._pick_master()
        if m is None or m.proc is None:
            return False
        m.proc.kill()
        gap = self.rng.uniform(0.1, 1.0)
        self.busy.add(f"m{m.port}")
        self._record("master_kill", f"m{m.port}", gap)

        def restart() -> None:
            self.cl.start_master(m)  # same port: clients with a host:port reconnect to it
            self.busy.discard(f"m{m.port}")
        self.later(gap, f"restart master {m.port}", restart)
        return True

    def _master_freeze(self) -> bool:
        m = self._pick_master()
        if m is None or m.proc is None:
            return False
        dur = self.rng.uniform(0.2, 2.5)
        pid = m.proc.proc.pid
        self.cl.signal_group(pid, signal.SIGSTOP)
        m.frozen = True
        self.busy.add(f"m{m.port}")
        self._record("master_freeze", f"m{m.port}", dur)

        def thaw() -> None:
            self.cl.signal_group(pid, signal.SIGCONT)
            m.frozen = False
            self.busy.discard(f"m{m.port}")
        self.later(dur, f"thaw master {m.port}", thaw)
        return True

    def _pick_proxy(self) -> MasterSlot | None:
        ok = [m for m in self.cl.masters if f"p{m.port}" not in self.busy]
        return self.rng.choice(ok) if ok else None

    def _link_cut(self) -> bool:
        m = self._pick_proxy()
        if m is None or m.proxy is None:
            return False
        proxy = m.proxy
        dur = self.rng.uniform(0.2, 2.5)
        proxy.set_cut(True)
        self.busy.add(f"p{m.port}")
        self._record("link_cut", f"p{m.port}", dur)

        def lift() -> None:
            proxy.set_cut(False)
            self.busy.discard(f"p{m.port}")
        self.later(dur, "lift cut", lift)
        return True

    def _link_delay(self) -> bool:
        m = self._pick_proxy()
        if m is None or m.proxy is None:
            return False
        proxy = m.proxy
        dur = self.rng.uniform(0.3, 2.5)
        # Sometimes longer than the client timeout: calls time out on the client and still arrive.
        proxy.delay_s = self.rng.uniform(*self.cl.cfg.link_delay_s)
        self.busy.add(f"p{m.port}")
        self._record("link_delay", f"p{m.port}", dur, delay=proxy.delay_s)

        def lift() -> None:
            proxy.delay_s = 0.0
            self.busy.discard(f"p{m.port}")
        self.later(dur, "lift delay", lift)
        return True

    def _etcd_kill(self) -> bool:
        if self.cl.etcd is None or "etcd" in self.busy:
            return False
        self.cl.etcd.kill()
        gap = self.rng.uniform(0.3, 2.0)
        self.busy.add("etcd")
        self._record("etcd_kill", "etcd", gap)

        def restart() -> None:
            self.cl.start_etcd()  # same ports and data dir
            self.busy.discard("etcd")
        self.later(gap, "restart etcd", restart)
        return True

    def _etcd_freeze(self) -> bool:
        if self.cl.etcd is None or "etcd" in self.busy:
            return False
        dur = self.rng.uniform(0.3, 2.5)
        pid = self.cl.etcd.pid
        self.cl.signal_group(pid, signal.SIGSTOP)
        self.cl.etcd_frozen = True
        self.busy.add("etcd")
        self._record("etcd_freeze", "etcd", dur)

        def thaw() -> None:
            self.cl.signal_group(pid, signal.SIGCONT)
            self.cl.etcd_frozen = False
            self.busy.discard("etcd")
        self.later(dur, "thaw etcd", thaw)
        return True

    def _node_id_clash(self) -> bool:
        """A second process registers a live holder's node id (issue 9 hole 2), then dies."""
        p = self._pick_holder()
        if p is None or "clash" in self.busy:
            return False
        dup = self.cl.start_holder(100 + p.holder, kind="dup", node_holder=p.holder)
        dur = self.rng.uniform(1.0, 3.0)
        self.busy.add("clash")
        self._record("node_id_clash", dup.name, dur, node_of=p.name)
        give_up = time.monotonic() + DUP_START_BOUND_S

        def end() -> None:
            dup.proc.kill()
            self.dup_killed_at = time.monotonic()
            self.busy.discard("clash")

        # The clash lasts ``dur`` from the second process's registration, not from its spawn: on a
        # loaded machine its imports alone can outlast ``dur``, and a process killed before it
        # registered displaced nobody.
        def when_registered() -> None:
            if self.flushing or not dup.proc.alive() or time.monotonic() >= give_up:
                self.later(0.0, "end clash", end)
            elif self.cl.has_started(dup):
                self.later(dur, "end clash", end)
            else:
                self.later(0.1, "wait for the clash's registration", when_registered)
        self.later(0.1, "wait for the clash's registration", when_registered)
        return True


def _wait(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def wait_record(progress: Progress, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any] | None:
    """The first record (logged so far or within ``timeout_s``) that ``pred`` accepts, else None."""
    found = [r for r in progress.recs if pred(r)]
    if found:
        return found[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in progress.poll():
            if pred(r):
                return r
        time.sleep(0.05)
    return None


Scenario = Callable[[Cluster, Injector], None]
Until = Callable[[Progress], bool]
RESTART_BOUND_S = 20.0  # a holder restarted at the end of the faults: imports (torch too) and registration


def run(cfg: ChaosConfig, scenario: Scenario | None = None, recovery_s: float = 5.0, until: Until | None = None,
        recovery_reads: int = 5) -> dict[str, Any]:
    """One history. ``scenario`` replaces the random injector with a scripted sequence of faults
    (it gets the cluster and an injector for logging, and the run's progress). ``until`` ends the
    faults once it says the work is done (it gets the run's :class:`Progress`); ``cfg.duration_s``
    is then the hard bound, and without it the faults last that long.

    After the faults stop, the run waits until every live holder has had a publish accepted again
    (a clash's killed second process: until its lease has lapsed too), then readers go on until
    each made ``recovery_reads`` reads or ``recovery_s`` passed: reads failing then are counted as
    ``recovery_failures`` (a fault whose effect outlives it). Then the quiet period: readers stop,
    holders unpublish what they hold, and it ends once every holder is drained and the masters
    hold no lock and no entry (or nothing changed for a lease: a leak), within its bound."""
    assert cfg.workdir, "config.workdir is required"
    os.makedirs(cfg.workdir, exist_ok=True)
    rng = random.Random(cfg.seed)
    cl = Cluster(cfg)
    t_start = time.monotonic()
    stats: list[dict] = []
    progress = Progress(os.path.join(cfg.workdir, "logs"), cfg)
    until_met, run_s = False, 0.0
    try:
        cl.start_infra()
        log = OpLog(os.path.join(cfg.workdir, "logs", "harness.jsonl"), "harness")
        log.write("config", config=json.loads(cfg.to_json()))
        for h in range(cfg.holders + cfg.kv_holders):
            cl.start_holder(h)
        for r in range(cfg.readers + cfg.kv_readers):
            cl.start_reader(r)
        # Faults start once every process is up (torch and the connector halves take seconds to
        # import on a loaded machine): a holder whose first registration already met a fault
        # would spend the run unregistered and the scenario would test nothing.
        _wait(cl.all_started, 90)
        inj = Injector(cl, log, rng, progress)
        t_run = time.monotonic()
        next_fault = t_run + rng.uniform(*cfg.fault_gap_s)
        next_check = t_run
        if scenario is not None:
            scenario(cl, inj)
        while scenario is None and time.monotonic() - t_run < cfg.duration_s:
            inj.run_due()
            if time.monotonic() >= next_fault:
                inj.inject()
                next_fault = time.monotonic() + rng.uniform(*cfg.fault_gap_s)
            if until is not None and time.monotonic() >= next_check:
                progress.poll()
                if until(progress):
                    until_met = True
                    break
                # The checker's cost grows with the history: its share of 2 busy cores stays small.
                next_check = time.monotonic() + max(0.5, 10 * progress.report_s)
            time.sleep(0.02)
        run_s = time.monotonic() - t_run
        # Faults stop: undo everything (restarts happen now), then readers stop.
        inj.run_due(flush=True)
        cl.thaw_all()
        for d in cl.live("dup"):
            d.proc.kill()
            inj.dup_killed_at = time.monotonic()
        log.write("faults_stopped")
        t_stopped = time.time()
        back: set[str] = set()

        def holders_back() -> bool:
            for r in progress.poll():
                if r["op"] in ("publish", "republish") and r.get("ok") and r["t0"] >= t_stopped:
                    back.add(r["proc"])
            gone = {r["proc"] for r in progress.recs if r["op"] == "superseded"}
            return (time.monotonic() >= inj.dup_killed_at + cfg.lease_ttl_s + cfg.master_timeout_s
                    and all(p.name in back or p.name in gone for p in cl.live("holder")))
        _wait(holders_back, cfg.lease_ttl_s + cfg.master_timeout_s + RESTART_BOUND_S, 0.1)
        log.write("recovery_window")
        t_window = time.time()
        reads: dict[str, int] = {}

        def readers_read() -> bool:
            for r in progress.poll():
                if r["op"] in ("read", "kvread") and r["lookup_t0"] >= t_window:
                    reads[r["proc"]] = reads.get(r["proc"], 0) + 1
            return all(reads.get(p.name, 0) >= recovery_reads for p in cl.live("reader"))
        _wait(readers_read, recovery_s, 0.1)
        cl.touch("stop")
        _wait(lambda: not cl.live("reader"), 3 * (cfg.master_timeout_s + cfg.read_timeout_s) + 10)
        # Quiet period: every retention, lock and lease runs out; holders unpublish as usual. It
        # ends once every holder is drained (holds nothing, and publishes nothing once stopped) and
        # the masters hold no lock and no entry; with locks gone and nothing changing for a lease
        # (a dead process's registration lapses within it) whatever is left is a leak.
        quiet = cfg.retention_s[1] + cfg.lock_ttl_s + cfg.lease_ttl_s + 3.0 + cfg.master_timeout_s
        t_quiet, drained = time.monotonic(), set()
        last: tuple | None = None
        same_since = time.monotonic()
        while time.monotonic() - t_quiet < quiet:
            drained |= {r["proc"] for r in progress.poll() if r["op"] == "drained"}
            st = cl.master_stats()
            snap = tuple((x.get("locks"), x.get("entries")) for x in st)
            if snap != last:
                last, same_since = snap, time.monotonic()
            settled = (bool(st) and all(x.get("locks") == 0 for x in st)
                       and all(p.name in drained for p in cl.live("holder")))
            if settled and (all(x.get("entries") == 0 for x in st)
                            or time.monotonic() - same_since >= cfg.lease_ttl_s + cfg.master_timeout_s):
                break
            time.sleep(0.1)
        stats = cl.master_stats()
        log.write("master_stats", stats=stats)
        cl.touch("exit")
        _wait(lambda: not cl.live("holder"), 15)
        stragglers = [p.name for p in cl.procs if p.proc.alive()]
        log.write("end", stragglers=stragglers, faults=inj.counts)
        log.close()
    finally:
        cl.close()
    report = checker.check(os.path.join(cfg.workdir, "logs"), cfg, stats)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    report["run_s"] = round(run_s, 1)
    report["until_met"] = until_met
    return report
