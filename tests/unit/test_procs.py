"""pdxfer/common/procs.py with real processes and sockets: group stop, parent death, bounded waits."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdxfer.common.procs import (
    ManagedProcess,
    free_port,
    read_port_file,
    wait_for,
    wait_http_ready,
    wait_port_file,
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent may not have reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_managed_process_stop_kills_whole_group_even_if_term_ignored(tmp_path: Path) -> None:
    # Leader ignores SIGTERM and has two grandchildren: stop() must escalate and leave nothing.
    script = "trap '' TERM; sleep 300 & sleep 300 & echo $! > {}; wait".format(tmp_path / "gc")
    p = ManagedProcess(["bash", "-c", script], tmp_path / "p.log", name="stubborn")
    deadline = time.monotonic() + 10
    while not (tmp_path / "gc").exists() or not (tmp_path / "gc").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = int((tmp_path / "gc").read_text())
    assert p.alive() and _pid_alive(grandchild)
    t0 = time.monotonic()
    p.stop(timeout=1)
    assert time.monotonic() - t0 < 5
    assert not p.alive()
    deadline = time.monotonic() + 5
    while _pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _pid_alive(grandchild)


def test_die_with_parent_child_goes_when_parent_is_killed(tmp_path: Path) -> None:
    # A parent that is SIGKILLed cannot run cleanup: its managed child must still go.
    code = ("import sys, time; from pathlib import Path; from pdxfer.common.procs import ManagedProcess;"
            f"p = ManagedProcess(['sleep', '300'], Path({str(tmp_path / 'c.log')!r}), "
            "die_with_parent=True); print(p.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        child = int(parent.stdout.readline())
        assert _pid_alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _pid_alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(child, 9)
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass


def test_wait_http_ready_reports_dead_process_with_log(tmp_path: Path) -> None:
    p = ManagedProcess([sys.executable, "-c", "print('boom: bad flag --xyz'); raise SystemExit(3)"],
                       tmp_path / "dead.log", name="dies")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)dies .*exited with 3.*boom: bad flag --xyz"):
            wait_http_ready(f"http://127.0.0.1:{free_port()}/health", 20, p, interval=0.05)
    finally:
        p.stop(1)


def test_wait_http_ready_times_out_and_succeeds() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=str(port)):
        wait_http_ready(f"http://127.0.0.1:{port}/health", 0.5, interval=0.05)
    assert time.monotonic() - t0 < 5

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        wait_http_ready(f"http://127.0.0.1:{srv.server_address[1]}/health", 5, interval=0.05)
        with pytest.raises(TimeoutError, match="HTTP 404"):
            wait_http_ready(f"http://127.0.0.1:{srv.server_address[1]}/nope", 0.3, interval=0.05)
    finally:
        srv.shutdown()
        srv.server_close()


def test_wait_port_file_reads_ports_and_names_a_dead_writer(tmp_path: Path) -> None:
    port_file = tmp_path / "ports"
    code = f"import os, time; time.sleep(0.3); open({str(port_file)+'.t'!r}, 'w').write('4711\\n4712\\n'); " \
           f"os.replace({str(port_file)+'.t'!r}, {str(port_file)!r}); time.sleep(30)"
    p = ManagedProcess([sys.executable, "-c", code], tmp_path / "w.log", name="writer")
    try:
        assert read_port_file(port_file) is None  # not written yet
        assert wait_port_file(port_file, 20, p) == [4711, 4712]
    finally:
        assert p.stop(2) == -15  # SIGTERM ended it (no handler), within the bound
    dead = ManagedProcess([sys.executable, "-c", "print('no ports today'); raise SystemExit(4)"],
                          tmp_path / "d.log", name="quitter")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)quitter .*exited with 4.*no ports today"):
            wait_port_file(tmp_path / "never", 20, dead)
    finally:
        dead.stop(1)
    (tmp_path / "junk").write_text("port: x\n")
    with pytest.raises(RuntimeError, match="not port numbers"):
        read_port_file(tmp_path / "junk")


def test_wait_for_is_bounded_and_returns_the_value() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no thing that never comes after 0.2 s"):
        wait_for(lambda: None, 0.2, "thing that never comes")
    assert time.monotonic() - t0 < 2
    calls = []
    assert wait_for(lambda: calls.append(1) or (len(calls) if len(calls) >= 3 else None), 5, "third call") == 3
