"""`pdxfer launch`'s supervision (pdxfer.launch.supervise) on real child processes killed with real
signals: the dead one is started again with its own argv and log, the others are never touched,
a process that keeps dying is left down, and a proxy left down ends the fleet."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pdxfer.common.procs import ManagedProcess
from pdxfer.launch.fleet import Component, Stack
from pdxfer.launch.supervise import RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import sys, time; print('up', sys.argv[1:], flush=True); time.sleep(120)"]


def _stack(tmp_path: Path, *names: str) -> Stack:
    stack = Stack()
    for name in names:
        stack.add(Component(name, ManagedProcess([*SLEEPER, name], tmp_path / f"{name}.log", name=name),
                            ready=True))
    return stack


def _log_shows(path: Path, line: str, times: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.read_text().count(line) < times:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(comp: Component) -> None:
    os.killpg(comp.proc.pid, signal.SIGKILL)
    comp.proc.poll()
    deadline = time.monotonic() + 5
    while comp.proc.alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_killed_process_comes_back_with_its_own_argv_and_log_and_the_rest_are_untouched(tmp_path) -> None:
    stack = _stack(tmp_path, "prefill-0", "decode-0", "proxy")
    try:
        stack["proxy"].restart_argv = [*SLEEPER, "proxy", "--port", "8123"]
        pids = {c.name: c.proc.pid for c in stack.components}
        sup = Supervisor(stack, RestartPolicy(backoff_s=0.0))
        assert sup.check() == []
        assert all(_log_shows(tmp_path / f"{c.name}.log", f"up ['{c.name}']", 1) for c in stack.components)
        _kill(stack["prefill-0"])
        _kill(stack["proxy"])
        died = sup.check()
        assert len(died) == 2 and all("exited with -9" in line and "restarting it in 0 s (restart 1 of 5)" in line
                                      for line in died), died
        assert f"log {tmp_path / 'prefill-0.log'}" in died[0]
        restarted = sup.check()
        assert [line.split(" ")[0] for line in restarted] == ["prefill-0", "proxy"], restarted
        back = sup.check()
        assert [line.split(" ")[0] for line in back] == ["prefill-0", "proxy"] and "is back after" in back[0]
        assert stack["decode-0"].proc.pid == pids["decode-0"] and stack["decode-0"].proc.alive()
        assert stack["prefill-0"].proc.pid != pids["prefill-0"] and stack["prefill-0"].proc.alive()
        assert _log_shows(tmp_path / "prefill-0.log", "up ['prefill-0']", 2)  # the restart continues the log
        assert _log_shows(tmp_path / "proxy.log", "up ['proxy', '--port', '8123']", 1)  # its restart argv
        assert sup.check() == [] and not sup.fatal
    finally:
        stack.stop(2)


def test_the_restart_waits_double_each_time_and_a_process_that_keeps_dying_stays_down(tmp_path) -> None:
    now = [100.0]
    stack = _stack(tmp_path, "decode-0")
    try:
        sup = Supervisor(stack, RestartPolicy(max_restarts=2, window_s=60, backoff_s=1, max_backoff_s=30),
                         clock=lambda: now[0])
        waits = []
        for _ in range(2):
            _kill(stack["decode-0"])
            (line,) = sup.check()
            waits.append(line.split("restarting it in ")[1].split(" ")[0])
            assert sup.check() == []  # not before its backoff
            now[0] += float(waits[-1])
            assert "restarted" in sup.check()[0]
            assert "is back" in sup.check()[0]
        assert waits == ["1", "2"]
        _kill(stack["decode-0"])
        (line,) = sup.check()
        assert "restarted 2 time(s) within 60 s: not restarting it, the rest go on" in line
        assert sup.state("decode-0") == "down" and not sup.fatal
        now[0] += 1000
        assert sup.check() == [] and not stack["decode-0"].proc.alive()
    finally:
        stack.stop(2)


def test_a_proxy_left_down_ends_the_fleet(tmp_path) -> None:
    stack = _stack(tmp_path, "proxy")
    try:
        sup = Supervisor(stack, RestartPolicy(max_restarts=0))
        _kill(stack["proxy"])
        (line,) = sup.check()
        assert "not restarting it" in line and sup.fatal == "the proxy exited 1 times within 600 s"
    finally:
        stack.stop(2)


def test_a_bad_policy_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="max_restarts >= 0"):
        RestartPolicy(max_restarts=-1)
