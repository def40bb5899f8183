"""`pdxfer launch` end to end: real master, two real `vllm serve` instances, the proxy.

One launch (the heavy part, ~1-2 min on 2 cores) serves three checks: readiness and the printed
endpoints, the demo (prompts through the proxy; the decode side really loaded prefill's chunks),
and a clean stop on SIGTERM that leaves no process behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdxfer.serve.launch import TRANSFER_COUNTER, read_prom_counter, run_demo
from pdxfer.serve.tiny_model import default_tiny_model_dir, make_tiny_model
from tests.vllm.conftest import kill_process_groups, PAIR_VLLM_ARGS, ask_url, check_logprobs, prompt_of

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().split(")")[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def test_launch_rejects_bad_model_dir(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch", str(tmp_path / "nothing")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--make-tiny-model" in r.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_launch_demo_and_clean_stop(tmp_path: Path) -> None:
    model = make_tiny_model(default_tiny_model_dir())
    log = tmp_path / "launch.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdxfer.cli", "launch", str(model), "--port", "0",
             "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "400",
             "--proxy-arg=--skip-prefill-tokens=0",  # the short demo prompt too goes through a prefill
             *(f"--vllm-arg={a}" for a in PAIR_VLLM_ARGS)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids: dict[str, int] = {}
    urls: dict[str, str] = {}
    pgids: list[int] = []
    try:
        deadline = time.monotonic() + 450
        while "Ctrl-C stops everything" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert "pdxfer connector, transport tcp" in text
        for name, pid, url in re.findall(r"^\s+(master|prefill|decode|proxy)\s+pid (\d+)\s+(\S+)",
                                         text, re.M):
            pids[name] = int(pid)
            urls[name] = url
        assert set(pids) == {"master", "prefill", "decode", "proxy"}
        pgids = list(pids.values())  # each child leads its own process group
        proxy_url, decode_url = urls["proxy"], urls["decode"]
        assert f"curl -s {proxy_url}/v1/completions" in text

        lines: list[str] = []
        before = read_prom_counter(decode_url, TRANSFER_COUNTER)
        assert run_demo(proxy_url, decode_url, "tiny", connector=True, out=lines.append), lines
        pairs = re.findall(r"(\d+) prompt tokens, .* decode loaded (\d+) tokens", "\n".join(lines))
        assert len(pairs) == 3
        # Every prompt token but the last (full chunks and the tail), the short one included.
        assert [int(n) - 1 for n, _ in pairs] == [int(k) for _, k in pairs], "\n".join(lines)
        loaded = [int(k) for _, k in pairs]
        assert read_prom_counter(decode_url, TRANSFER_COUNTER) - before == sum(loaded)

        # The pair oracle through the proxy (float32): top-k logprobs equal the prefill computing
        # the prompt itself, and vLLM on the decode did not compute all but its last token.
        prompt = prompt_of(700, seed=4500)
        ref = ask_url(urls["prefill"], prompt, 12)
        got = ask_url(proxy_url, prompt, 12, forward_hint=False)  # the proxy forwards the hint itself
        assert got.cached_tokens == len(prompt) - 1
        check_logprobs(got, ref)

        # Streaming chat through the proxy to the real instances: SSE events, then [DONE].
        body = {"model": "tiny", "messages": [{"role": "user", "content": "the data block"}],
                "max_tokens": 8, "temperature": 0, "stream": True}
        req = urllib.request.Request(proxy_url + "/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [ln.decode().strip() for ln in r if ln.strip()]
        assert events[-1] == "data: [DONE]"
        deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                  for e in events[:-1] if json.loads(e[6:]).get("choices")]
        assert "".join(deltas)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
        assert "all processes stopped" in log.read_text()
        for g in pgids:
            assert _group_members(g) == [], f"process group {g} left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        kill_process_groups(pgids)
