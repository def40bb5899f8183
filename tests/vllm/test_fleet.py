"""A 2x2 fleet through `pdxfer launch --prefill 2 --decode 2` (tiny model, float32), checked
against a plain `vllm serve` of the same model (no connector) computing every prompt itself:

- a multi-turn conversation (each turn: the previous prompt + its answer + a new message) whose
  every answer has the plain instance's top-k logprobs, whose decodes computed only the last
  prompt token, and whose second turn goes to the instances holding the first turn's prefix;
- a prompt the fleet already holds (a prefill computed it, no decode has it) skips the prefill:
  the route header and the proxy's metric say so, no prefill instance sees it, and the decode
  loads every prompt token but the last;
- a prompt both prefill instances hold, asked while the holder the master's tie-break is steered
  to (test hook ``tie_break_node``) is frozen (SIGSTOP): the decode re-pulls every chunk from the
  other prefill, the answer has the plain instance's logprobs, every prompt token but the last is
  loaded and nothing is recomputed;
- a prefill and then the proxy SIGKILLed: launch starts each again on its port while the fleet
  keeps answering (the plain instance's logprobs); the master SIGKILLed: back empty, its holders
  fill the index again within seconds and a decode loads the prompt it held;
- what a user of `pdxfer launch` sees: the printed endpoints and example, the demo's prompts
  (those routed through a prefill loaded but their last token, the short one computed by a
  decode), a streamed chat answer, and SIGTERM stopping every process it started.

Heavy: five vLLM instances (four in the fleet, the plain one), several minutes on small boxes.
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
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.common.procs import ManagedProcess, free_port, wait_http_ready
from pdxfer.master import MasterClient
from pdxfer.master.server.index import TEST_HOOKS_ENV, TIE_HOOK, ChunkIndex
from pdxfer.master.wire.protocol import pack_u32
from pdxfer.serve.index_view import IndexView, lookup_keys
from pdxfer.launch.fleet import TRANSFER_COUNTER, proxy_ready_url, read_prom_counter, run_demo
from pdxfer.launch.serve_shim import start_vllm
from tests.vllm.conftest import (kill_process_groups, EXTERNAL_HITS, PAIR_VLLM_ARGS, READY_TIMEOUT_S, TOP_K, Answer,
                                 ask_url, check_logprobs, post_json, prompt_of)

ROOT = Path(__file__).resolve().parents[2]
ANSWER_TOKENS = 12
_TABLE = re.compile(r"^\s+(master|proxy|prefill-\d+|decode-\d+)\s+pid (\d+)\s+(\S+)", re.M)


class Fleet:
    """The launched fleet: component URLs by name (the master's is its host:port)."""

    def __init__(self, proc: subprocess.Popen, urls: dict[str, str], pgids: list[int], log: Path,
                 hooks: Path) -> None:
        self.proc = proc
        self.urls = urls
        self.pgids = pgids
        self.log = log  # what `pdxfer launch` printed
        self.hooks = hooks  # every process's $PDXFER_TEST_HOOKS_DIR (empty: every hook inert)

    @property
    def proxy(self) -> str:
        return self.urls["proxy"]

    def role(self, role: str) -> list[str]:
        return [u for n, u in sorted(self.urls.items()) if n.startswith(role + "-")]

    def counter(self, role: str, name: str) -> float:
        return sum(read_prom_counter(u, name) for u in self.role(role))

    def connector_log(self, last: int = 30) -> str:
        """The instances' last connector lines: what a failed check's message needs to say why."""
        lines = []
        for path in sorted((self.log.parent / "logs").glob("*-[0-9].log")):
            lines += [f"{path.stem}: {ln}" for ln in path.read_text(errors="replace").splitlines()
                      if "pdxfer:" in ln][-last:]
        return "\n".join(lines)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model) -> Iterator[Fleet]:
    run = tmp_path_factory.mktemp("fleet")
    log = run / "launch.out"
    hooks = run / "hooks"
    hooks.mkdir()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdxfer.cli", "launch", str(tiny_model), "--prefill", "2",
             "--decode", "2", "--port", "0", "--log-dir", str(run / "logs"),
             "--ready-timeout", str(READY_TIMEOUT_S), *(f"--vllm-arg={a}" for a in PAIR_VLLM_ARGS)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, TEST_HOOKS_ENV: str(hooks)})
    pgids: list[int] = []
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S + 60
        while "Ctrl-C stops everything" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        found = _TABLE.findall(log.read_text())
        urls = {name: url for name, _, url in found}
        pgids = [int(pid) for _, pid, _ in found]  # each child leads its own process group
        assert set(urls) == {"master", "proxy", "prefill-0", "prefill-1", "decode-0", "decode-1"}
        yield Fleet(proc, urls, pgids, log, hooks)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        kill_process_groups(pgids)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_model) -> Iterator[str]:
    """The reference: the same model served without any connector."""
    port = free_port()
    proc: ManagedProcess = start_vllm(tiny_model, port, None, cpu_bind=str(min(os.sched_getaffinity(0))),
                                      log_dir=tmp_path_factory.mktemp("plain"), extra_args=PAIR_VLLM_ARGS,
                                      name="plain")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url + "/health", READY_TIMEOUT_S, proc)
        yield url
    finally:
        proc.stop(15)


def ask_routed(proxy_url: str, prompt: list[int], max_tokens: int) -> tuple[Answer, dict[str, str]]:
    """A greedy completion of token ids through the proxy, with top-k logprobs; the response headers."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "logprobs": TOP_K, "return_tokens_as_token_ids": True}
    rid = f"t-{uuid.uuid4().hex[:16]}"
    req = urllib.request.Request(proxy_url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=180) as r:
        out = json.loads(r.read())
        headers = {k.lower(): v for k, v in r.headers.items()}
    choice = out["choices"][0]
    lp = choice["logprobs"]
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return Answer(choice["text"], list(lp["tokens"]), [dict(t or {}) for t in lp["top_logprobs"]],
                  details.get("cached_tokens"), rid), headers


def answer_ids(a: Answer) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in a.tokens]  # "token_id:N" (return_tokens_as_token_ids)


def wait_held(view: IndexView, prompt: list[int], tokens: int, url: str | None = None,
              timeout: float = 15.0) -> None:
    """Publishes land after the answer: wait (bounded) until the fleet (or ``url``) holds
    ``tokens`` leading tokens of ``prompt``."""
    deadline = time.monotonic() + timeout
    while True:
        h = view.holding(prompt)
        have = h.held_tokens if url is None else h.by_url.get(url, 0)
        if have >= tokens:
            return
        assert time.monotonic() < deadline, f"the fleet holds {have} of {tokens} tokens ({url or 'any'})"
        time.sleep(0.1)


def routes_metric(proxy_url: str, **labels: str) -> float:
    text = urllib.request.urlopen(proxy_url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdxfer_proxy_routes_total{")
               and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _route_urls(headers: dict[str, str]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in headers["x-pdxfer-route"].split())


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_a_multi_turn_conversation_through_a_2x2_fleet(fleet: Fleet, plain: str) -> None:
    view = IndexView(fleet.urls["master"], timeout_s=5.0)
    C = 256  # the connector's default chunk size (launch sets none)
    system = prompt_of(600, seed=8100)
    prompt = system + prompt_of(100, seed=8101)
    first_route: dict[str, str] = {}
    previous: Answer | None = None
    try:
        for turn, new_message in enumerate((0, 300, 280)):
            if previous is not None:  # the next turn: what was said so far + a new message
                prompt = prompt + answer_ids(previous) + prompt_of(new_message, seed=8100 + 10 * turn)
            ref = ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False)
            if turn == 1:
                # The first turn's decode publishes its prompt + answer: wait until it is in the
                # index, then the second turn must go where the first turn's prefix is.
                wait_held(view, prompt, 2 * C, first_route["decode"])
            answer, headers = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)
            check_logprobs(answer, ref)
            # Whatever the route, the decode computed only the last prompt token itself.
            assert answer.cached_tokens == len(prompt) - 1, (turn, headers)
            route = _route_urls(headers)
            if turn == 0:
                assert set(route) == {"prefill", "decode"}, headers
                assert headers["x-pdxfer-route-reason"].startswith("least-loaded"), headers
                first_route = route
            if turn == 1:
                assert route == first_route, headers
                assert headers["x-pdxfer-route-reason"].startswith("prefill-holder; decode=holder"), headers
            previous = answer
    finally:
        view.close()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_prompt_the_fleet_holds_skips_the_prefill_and_loads_all_but_its_last_token(
        fleet: Fleet, plain: str) -> None:
    view = IndexView(fleet.urls["master"], timeout_s=5.0)
    try:
        prompt = prompt_of(700, seed=8200)
        ref = ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False)
        # A prefill instance computes it outside the proxy: the fleet holds it, no decode has it.
        post_json(fleet.role("prefill")[0] + "/v1/completions",
                  {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        wait_held(view, prompt, len(prompt))
        skips = routes_metric(fleet.proxy, decision="decode-only", reason="skip-prefill")
        prefill_requests = fleet.counter("prefill", "vllm:request_success_total")
        hits = fleet.counter("decode", EXTERNAL_HITS)
        answer, headers = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)
        assert headers["x-pdxfer-route"].startswith("decode-only="), headers
        assert headers["x-pdxfer-route-reason"].startswith(
            f"skip-prefill; decode=least-loaded; held={len(prompt)}/{len(prompt)}"), headers
        assert routes_metric(fleet.proxy, decision="decode-only", reason="skip-prefill") == skips + 1
        check_logprobs(answer, ref)
        assert answer.cached_tokens == len(prompt) - 1
        deadline = time.monotonic() + 10  # vLLM's counters move one engine step later
        while fleet.counter("decode", EXTERNAL_HITS) - hits < len(prompt) - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.counter("decode", EXTERNAL_HITS) - hits == len(prompt) - 1
        assert fleet.counter("prefill", "vllm:request_success_total") == prefill_requests
    finally:
        view.close()


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_status_lists_every_instance_with_its_role_and_the_prefills_chunks(fleet: Fleet) -> None:
    """`pdxfer status --json` on the fleet the earlier tests used: the four instances with their
    roles (prefills read too: kv_both; decodes register as holders too), each a node of its own,
    and the prefills' chunks."""
    out = subprocess.run([sys.executable, "-m", "pdxfer.cli", "status", "--master", fleet.urls["master"], "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["master"]["leader"] is True
    nodes = doc["nodes"]
    assert sorted(n["role"] for n in nodes) == ["kv_both"] * 2 + ["kv_consumer"] * 2, nodes
    assert len({n["node_id"] for n in nodes}) == 4
    prefills = [n for n in nodes if n["role"] == "kv_both"]
    assert sum(n["entries"] for n in prefills) > 0 and sum(n["blocks"] for n in prefills) > 0, prefills
    for n in nodes:
        assert n["transport"] == "tcp" and n["endpoints"][0]["endpoint"], n
        assert n["layout"]["chunk_tokens"] == 256 and n["layout"]["namespace"], n


REPULLS = "vllm:pdxfer_repulls_total"
FAILED_LOADS = "vllm:pdxfer_loads_failed_total"


def _tie_picks(ix: ChunkIndex, keys: list[bytes], lookups: int, **kw: Any) -> list[str]:
    """The holder each of ``lookups`` lookups of ``keys`` (held alike by every node) is given."""
    out = []
    for _ in range(lookups):
        res = ix.lookup_and_lock(keys, "r", 5.0, now=0.0, **kw)
        assert res.hit == len(keys) and len(res.runs) == 1, res.runs
        out.append(res.runs[0][0])
    return out


def _three_holders(keys: list[bytes]) -> ChunkIndex:
    ix = ChunkIndex()  # reads $PDXFER_TEST_HOOKS_DIR now
    for nid in ("a", "b", "c"):
        ix.register(nid, "{}", 100.0, now=0.0)
        ix.publish(nid, [(k, pack_u32([i])) for i, k in enumerate(keys)], None, now=0.0)
    return ix


def test_the_tie_break_hook_steers_only_while_its_variable_and_file_name_a_tied_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steer the re-pull test below relies on, and that it leaves the master's turns alone
    otherwise: without the variable the file is not read; with it, an absent or empty file or a
    node outside the tie leaves the turns as they were."""
    keys = [bytes([i]) * KEY_BYTES for i in range(3)]
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    turns = _tie_picks(_three_holders(keys), keys, 6)
    assert turns == ["a", "b", "c", "a", "b", "c"]
    (tmp_path / TIE_HOOK).write_text("c\n")
    assert _tie_picks(_three_holders(keys), keys, 6) == turns  # the variable unset: inert

    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    (tmp_path / TIE_HOOK).unlink()
    assert _tie_picks(_three_holders(keys), keys, 6) == turns  # no file: inert
    ix = _three_holders(keys)
    (tmp_path / TIE_HOOK).write_text("c\n")
    assert _tie_picks(ix, keys, 3) == ["c"] * 3  # read at each tie: no restart needed
    assert sorted(_tie_picks(ix, keys, 4, skip={"c": 0})) == ["a", "a", "b", "b"]  # c is not in the tie
    for text in ("", "zz"):  # empty, or no such node: the turns go on
        (tmp_path / TIE_HOOK).write_text(text)
        assert sorted(_tie_picks(ix, keys, 3)) == ["a", "b", "c"]
    (tmp_path / TIE_HOOK).unlink()
    assert sorted(_tie_picks(ix, keys, 3)) == ["a", "b", "c"]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_frozen_holder_is_re_pulled_from_the_other_prefill_holding_the_same_chunks(
        fleet: Fleet, plain: str) -> None:
    view = IndexView(fleet.urls["master"], timeout_s=5.0)
    client = MasterClient(fleet.urls["master"], timeout_s=5.0)
    frozen_url, other_url = fleet.role("prefill")
    pgid = next(int(pid) for name, pid, _ in _TABLE.findall(fleet.log.read_text()) if name == "prefill-0")
    hook = fleet.hooks / TIE_HOOK
    try:
        wait_http_ready(proxy_ready_url(fleet.proxy), 60)
        prompt = prompt_of(700, seed=8300)  # two full chunks and a tail
        ref = ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False)
        for url in (frozen_url, other_url):  # both prefills hold it (the second loads, then publishes)
            post_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
            wait_held(view, prompt, len(prompt), url)
        by_url = {n.serve_url: n for n in client.nodes()}
        frozen, other = by_url[frozen_url], by_url[other_url]
        keys, _ = lookup_keys(prompt, frozen.chunk_tokens, bytes.fromhex(frozen.namespace))
        # Every tie goes to the frozen holder, whatever other lookups come between, so the
        # decode's first read goes to it; the re-pull's lookup skips it, so no tie is left there.
        hook.write_text(frozen.node_id)
        res = client.lookup_and_lock(keys, reader="test-tie-probe", lock_ttl_s=5.0)
        client.release(res.lock_id, all_parties=True)
        assert res.hit_chunks == len(keys) and set(res.nodes) == {frozen.node_id}, (res.hit_chunks, res.nodes)
        before = {m: fleet.counter("decode", m) for m in (REPULLS, FAILED_LOADS, TRANSFER_COUNTER)}
        os.killpg(pgid, signal.SIGSTOP)  # its lease outlives the request: the master still names it
        try:
            answer, headers = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)
        finally:
            os.killpg(pgid, signal.SIGCONT)
            hook.unlink()
        assert headers["x-pdxfer-route"].startswith("decode-only="), headers
        deadline = time.monotonic() + 10  # the counters move one engine step later, maybe not the same one
        while ((fleet.counter("decode", TRANSFER_COUNTER) - before[TRANSFER_COUNTER] < len(prompt) - 1
                or fleet.counter("decode", REPULLS) - before[REPULLS] < len(keys))
               and time.monotonic() < deadline):
            time.sleep(0.2)
        shown = fleet.connector_log()
        # Every chunk (two full ones and the tail) was read again from the other prefill.
        assert fleet.counter("decode", REPULLS) - before[REPULLS] == len(keys), shown
        assert f"from holder(s) {other.node_id} instead of {frozen.node_id}" in shown, shown
        # Nothing recomputed: no load failed, every prompt token but the last loaded.
        assert fleet.counter("decode", FAILED_LOADS) == before[FAILED_LOADS], shown
        assert fleet.counter("decode", TRANSFER_COUNTER) - before[TRANSFER_COUNTER] == len(prompt) - 1, shown
        assert answer.cached_tokens == len(prompt) - 1, headers
        check_logprobs(answer, ref)
    finally:
        hook.unlink(missing_ok=True)
        client.close()
        view.close()
        # The next test needs every instance back in the proxy's rotation.
        wait_http_ready(proxy_ready_url(fleet.proxy), 60)


def _launch_says(fleet: Fleet, pattern: str, timeout: float) -> re.Match:
    """The first line `pdxfer launch` printed that matches ``pattern`` (waited for, bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, fleet.log.read_text(), re.M)
        if m:
            return m
        assert fleet.proc.poll() is None, fleet.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"launch never printed {pattern!r}:\n{fleet.log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_killed_prefill_and_a_killed_proxy_come_back_while_the_fleet_keeps_serving(
        fleet: Fleet, plain: str) -> None:
    """SIGKILL of a prefill's whole process group (API server, engine core) and then of the proxy:
    `pdxfer launch` keeps running, says what died with its exit code and log, and starts each again
    on its own port; while the prefill is down every request is answered, by the other prefill or
    decode-only, with the plain instance's logprobs; once it is back the proxy has every instance
    in rotation again."""
    pids = {name: int(pid) for name, pid, _ in _TABLE.findall(fleet.log.read_text())}
    wait_http_ready(proxy_ready_url(fleet.proxy), 60)
    os.killpg(pids["prefill-1"], signal.SIGKILL)
    died = _launch_says(fleet, rf"^prefill-1 \(pid {pids['prefill-1']}\) exited with -9; log (\S+); "
                               r"restarting it in 1 s \(restart 1 of 5\)$", 30)
    assert died.group(1).endswith("prefill-1.log")
    dead_url = fleet.urls["prefill-1"]
    for i in range(3):  # the fleet serves on while prefill-1 is away (it needs ~30 s to come back)
        prompt = prompt_of(300 + 37 * i, seed=9100 + i)
        answer, headers = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)
        assert dead_url not in headers["x-pdxfer-route"], headers
        check_logprobs(answer, ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False))

    os.killpg(pids["proxy"], signal.SIGKILL)
    _launch_says(fleet, rf"^proxy \(pid {pids['proxy']}\) exited with -9; log \S+; restarting it in 1 s", 30)
    back = _launch_says(fleet, r"^proxy is back after ([\d.]+) s \(pid (\d+)\)$", 60)
    fleet.pgids.append(int(back.group(2)))
    prompt = prompt_of(333, seed=9200)
    answer, _ = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)  # the same URL: it came back on its port
    check_logprobs(answer, ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False))

    back = _launch_says(fleet, r"^prefill-1 is back after ([\d.]+) s \(pid (\d+)\)$", READY_TIMEOUT_S)
    fleet.pgids.append(int(back.group(2)))
    wait_http_ready(proxy_ready_url(fleet.proxy), 60)  # every instance in the proxy's rotation again
    for name in ("master", "decode-0", "decode-1", "prefill-0"):  # nobody else was restarted
        assert not re.search(rf"^{name} \(pid \d+\) exited", fleet.log.read_text(), re.M), name
    assert post_json(dead_url + "/v1/completions", {"model": "tiny", "prompt": prompt_of(50, seed=9300),
                                                    "max_tokens": 1, "temperature": 0})["choices"]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_killed_master_comes_back_empty_and_its_holders_fill_the_index_again(fleet: Fleet, plain: str) -> None:
    """SIGKILL of the in-memory master: launch starts it again on its port, empty; every holder's
    lease keeper finds its node unknown, registers again and re-publishes what it still holds, so
    the fleet holds the prompt again within seconds (well under a lease period) and a decode loads
    every prompt token but the last, with the plain instance's logprobs."""
    view = IndexView(fleet.urls["master"], timeout_s=5.0)
    try:
        prompt = prompt_of(600, seed=9400)  # two full chunks and a tail
        ref = ask_url(plain, prompt, ANSWER_TOKENS, forward_hint=False)
        post_json(fleet.urls["prefill-0"] + "/v1/completions",
                  {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        wait_held(view, prompt, len(prompt), fleet.urls["prefill-0"])
        pid = next(int(p) for name, p, _ in _TABLE.findall(fleet.log.read_text()) if name == "master")
        os.killpg(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _launch_says(fleet, rf"^master \(pid {pid}\) exited with -9; log \S+; restarting it in 1 s", 30)
        back = _launch_says(fleet, r"^master is back after ([\d.]+) s \(pid (\d+)\)$", 60)
        fleet.pgids.append(int(back.group(2)))
        view.close()
        view = IndexView(fleet.urls["master"], timeout_s=5.0)  # a fresh client for the new process
        wait_held(view, prompt, len(prompt), fleet.urls["prefill-0"], timeout=30)
        refilled_s = time.monotonic() - t0
        print(f"master killed: back after {back.group(1)} s, the prompt held again {refilled_s:.1f} s after the kill")
        # The restart's 1 s wait, the master's start and at most one heartbeat period (lease_ttl_s/3):
        # well under the 10 s lease a holder's entries would otherwise wait out.
        assert refilled_s < 10.0, (refilled_s, fleet.connector_log())
        before = fleet.counter("decode", TRANSFER_COUNTER)
        answer, headers = ask_routed(fleet.proxy, prompt, ANSWER_TOKENS)
        deadline = time.monotonic() + 10  # the counter moves one engine step later
        while fleet.counter("decode", TRANSFER_COUNTER) - before < len(prompt) - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.counter("decode", TRANSFER_COUNTER) - before == len(prompt) - 1, (headers, fleet.connector_log())
        check_logprobs(answer, ref)
    finally:
        view.close()
        wait_http_ready(proxy_ready_url(fleet.proxy), 60)


def _alive_in_group(pgid: int) -> list[int]:
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


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_launch_output_the_demo_streaming_and_a_clean_stop(fleet: Fleet) -> None:
    """Last in the module: it stops the fleet."""
    text = fleet.log.read_text()
    assert "pdxfer connector, transport tcp" in text
    assert f"curl -s {fleet.proxy}/v1/completions" in text
    # Four instances on fewer cores share them: launch keeps a decode's busy-wait from starving
    # the holder on its core (without it this box's first loads failed at connect_timeout_s).
    assert ("instances share cores: PDXFER_VLLM_SPIN_SLEEP_US=200" in text) == (
        len(os.sched_getaffinity(0)) < 4 and "PDXFER_VLLM_SPIN_SLEEP_US" not in os.environ), text

    lines: list[str] = []
    decodes = fleet.role("decode")
    before = fleet.counter("decode", TRANSFER_COUNTER)
    assert run_demo(fleet.proxy, decodes, "tiny", connector=True, out=lines.append), "\n".join(lines)
    found = re.findall(r"(\d+) prompt tokens, .* decode loaded (\d+) tokens.*\n\s+route (\S+)", "\n".join(lines))
    shown = "\n".join(lines) + "\n" + fleet.connector_log()
    assert len(found) == 3, shown
    for n, loaded, route in found:
        if route.startswith("prefill="):  # every prompt token but the last (full chunks and the tail)
            assert int(loaded) == int(n) - 1, shown
        else:  # the short prompt (under the proxy's --skip-prefill-tokens): the decode computes it
            assert route.startswith("decode-only=") and int(n) <= 256 and int(loaded) == 0, shown
    assert sum(r.startswith("prefill=") for _, _, r in found) == 2, shown
    assert fleet.counter("decode", TRANSFER_COUNTER) - before == sum(int(k) for _, k, _ in found)

    # Streaming chat through the proxy to the real instances: SSE events, then [DONE].
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the data block"}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(fleet.proxy + "/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [ln.decode().strip() for ln in r if ln.strip()]
    assert events[-1] == "data: [DONE]"
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
              for e in events[:-1] if json.loads(e[6:]).get("choices")]
    assert "".join(deltas)

    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(60) == 130
    assert "all processes stopped" in fleet.log.read_text()
    for g in fleet.pgids:
        assert _alive_in_group(g) == [], f"process group {g} left behind"
