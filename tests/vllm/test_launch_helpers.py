"""launch.py helpers with real processes and sockets (no vLLM needed except the tiny model build)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdxfer.vllm.launch import (
    ManagedProcess,
    free_port,
    make_tiny_model,
    split_cores,
    vllm_serve_argv,
    vllm_serve_env,
    wait_http_ready,
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


def test_tiny_model_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=0)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a", seed=0) == a  # reused, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = make_tiny_model(tmp_path / "b", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with pytest.raises(ValueError, match="another seed"):
        make_tiny_model(tmp_path / "a", seed=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("mine")
    with pytest.raises(ValueError, match="not a pdxfer tiny model"):
        make_tiny_model(foreign)

    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(a)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 2, 64)
    assert cfg.max_position_embeddings >= 4096
    tok = AutoTokenizer.from_pretrained(a)
    assert 2000 <= len(tok) <= 4096 and len(tok) == cfg.vocab_size
    text = "the data block cache 12345 ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")


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
    code = ("import sys, time; from pathlib import Path; from pdxfer.vllm.launch import ManagedProcess;"
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


def test_vllm_argv_and_env(tmp_path: Path) -> None:
    argv = vllm_serve_argv(tmp_path, 1234, {"kv_connector": "PdxferConnector", "kv_role": "kv_both"},
                           ["--max-model-len", "4096"])
    assert argv[:4] == [sys.executable, "-m", "pdxfer.vllm.launch", "serve"]
    assert argv[argv.index("--port") + 1] == "1234"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-model-len", "4096"]
    assert '"kv_connector":"PdxferConnector"' in argv[argv.index("--kv-transfer-config") + 1]
    env = vllm_serve_env("1", tmp_path / "cache", {"X_EXTRA": "y"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["X_EXTRA"] == "y"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))


def test_split_cores_gives_disjoint_halves() -> None:
    assert split_cores([0, 1]) == ("0", "1")
    assert split_cores([3]) == ("3", "3")
    assert split_cores([4, 5, 6, 7, 8]) == ("4,5", "6,7,8")
    with pytest.raises(ValueError, match="no CPU"):
        split_cores([])
    p, d = split_cores()
    assert set(map(int, p.split(","))) | set(map(int, d.split(","))) == os.sched_getaffinity(0)
