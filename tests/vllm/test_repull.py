"""Re-pull from another holder: a real master process, real TCP holder processes (SIGKILLed or
SIGSTOPped mid-read) and pdxfer's two connector halves as vLLM drives them, in this process.

Two holders hold the same chunks: the load whose holder dies or freezes is read again from the
other one, the loaded KV equals the pattern token by token, the re-pulled chunks are counted,
nothing is recomputed, and the whole load stays within load_timeout_s. With no other holder the
load fails within the bound and vLLM recomputes it, as before.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from pdxfer.kv.keys import IncrementalHasher  # noqa: E402
from pdxfer.kv.layout import CPU  # noqa: E402
from pdxfer.master import MasterClient  # noqa: E402
from pdxfer.contracts.connector_config import ConnectorConfig  # noqa: E402
from pdxfer.vllm.scheduler.reader import ReaderPath  # noqa: E402
from pdxfer.vllm.scheduler.scheduler_state import SchedulerStats  # noqa: E402
from pdxfer.vllm.worker.worker_side import WorkerSide  # noqa: E402
from tests.chaos import kv  # noqa: E402
from tests.chaos.checker import repull_violations  # noqa: E402
from tests.transport.conftest import REPO, child_env, freeze, read_line, stop  # noqa: E402

C = 64
CHUNKS = 8
SEED = 5
LOAD_TIMEOUT_S = 3.0


class Reader:
    """One reader engine (TP 1): ReaderPath + WorkerSide over its own KV cache."""

    def __init__(self, master: str, block: int, kv_format: str = CPU) -> None:
        self.side = kv.Side(kv_format, block)
        self.req_blocks = -(-(CHUNKS * C + 1) // block)
        self.phys, caches, layout = kv.new_cache(self.side, 2 * self.req_blocks + 2)
        self.cfg = ConnectorConfig(master=master, transport="tcp", chunk_tokens=C, lookup_timeout_s=1.0,
                                   load_timeout_s=LOAD_TIMEOUT_S, read_timeout_floor_s=0.5, connect_timeout_s=1.0,
                                   lock_ttl_s=20.0, publish_hint_wait_s=0.0, staging_mib=8)
        self.worker = WorkerSide(self.cfg, node_id="reader", rank=0, expected_fingerprint=layout.fingerprint(),
                                 block_size=block, kv_format=kv_format, tp_size=1, total_kv_heads=kv.HEADS)
        self.worker.register_kv_caches(caches)
        self.hot = MasterClient(master, timeout_s=1.0)
        self.bg = MasterClient(master, timeout_s=1.0)
        self.path = ReaderPath(self.cfg, block_size=block, tp_size=1, total_kv_heads=kv.HEADS, reader_id="reader",
                               hot=self.hot, bg=self.bg, stats=SchedulerStats(),
                               hasher=lambda r, s: IncrementalHasher(C, kv.ROOT), own_node=lambda: None)
        self.path.set_local_layouts({0: layout})
        self.n = 0

    def lookup(self, prompt: int) -> tuple[str, list[int], int, str]:
        """Lookup and plan of ``prompt``: (request id, its blocks, tokens to load, the first holder)."""
        tokens = kv.prompt_tokens(SEED, prompt, CHUNKS, C)
        req = f"req{self.n}"
        self.n += 1
        hit, _ = self.path.get_num_new_matched_tokens(req, tokens, len(tokens), 0, None)
        assert hit == len(tokens) - 1, f"lookup of prompt {prompt} hit {hit} tokens"
        first = self.path._lookups[req].locations[0].node_id
        blocks = list(range(self.n % 2 * self.req_blocks, (self.n % 2 + 1) * self.req_blocks))
        kv.fill_blocks(self.phys, self.side, blocks)
        self.path.update_state_after_alloc(req, blocks, hit)
        return req, blocks, hit, first

    def load(self, req: str, blocks: list[int]) -> tuple[float, set[int]]:
        """Post the planned load, wait (bounded) until it ends: (seconds, blocks with load errors)."""
        t0 = time.monotonic()
        self.meta = self.path.take_metadata()  # what was posted, for tests to look at
        self.worker.start_loads(self.meta)
        deadline = t0 + 4 * LOAD_TIMEOUT_S
        while req not in self.worker.get_finished():
            assert time.monotonic() < deadline, "the load never ended"
            time.sleep(0.002)
        took = time.monotonic() - t0
        self.path.finish_request(req)
        return took, self.worker.take_load_errors() & set(blocks)

    def bad_tokens(self, prompt: int, blocks: list[int], n: int) -> int:
        got = kv.read_tokens(self.phys, self.side, blocks, 0, n)
        return kv.check_tokens(got, kv.prompt_tokens(SEED, prompt, CHUNKS, C), {})["bad"]

    def close(self) -> None:
        self.path.close()
        self.worker.close()
        self.hot.close()
        self.bg.close()


@pytest.fixture
def master():
    """A master per test: holders a previous test killed must not be found here."""
    from pdxfer.master import start_local_master

    m = start_local_master()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def holders(master):
    procs: dict[str, subprocess.Popen] = {}

    def start(node_id: str, block: int, prompts: list[int], *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tests.vllm.repull_holder", "--master", master.address, "--node-id", node_id,
               "--block", str(block), "--chunks", str(CHUNKS), "--chunk-tokens", str(C),
               "--prompts", ",".join(map(str, prompts)), "--seed", str(SEED), *extra]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                             env=child_env())
        procs[node_id] = p
        read_line(p, "READY", 60)
        return p

    yield start, procs
    for p in procs.values():
        stop(p)


@pytest.fixture
def reader(master):
    made: list[Reader] = []

    def make(block: int, kv_format: str = CPU) -> Reader:
        r = Reader(master.address, block, kv_format)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _fault(proc: subprocess.Popen, how: str) -> None:
    if how == "kill":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    else:
        freeze(proc.pid)


# (holder block size, reader block size): block for block, and token ranges through staging.
@pytest.mark.parametrize("how,hblock,rblock", [("kill", 32, 32), ("freeze", 32, 32), ("freeze", 128, 32),
                                               ("kill", 128, 32)])
def test_failed_holder_is_repulled_from_the_other(holders, reader, how, hblock, rblock, caplog):
    start, procs = holders
    # Both hold prompt 0; each also holds a prompt of its own, loaded first so that the reader is
    # connected to both and the fault meets a read in flight, not a first contact.
    start("ha", hblock, [0, 1])
    start("hb", hblock, [0, 2])
    r = reader(rblock)
    for warm in (1, 2):
        req, blocks, hit, _ = r.lookup(warm)
        took, errors = r.load(req, blocks)
        assert not errors and r.bad_tokens(warm, blocks, hit) == 0
    assert set(r.worker.connected_holders()) == {"ha", "hb"}
    r.worker.stats.take()
    req, blocks, hit, victim = r.lookup(0)
    other = ({"ha", "hb"} - {victim}).pop()
    _fault(procs[victim], how)
    r.worker.round_log = []
    with caplog.at_level(logging.INFO, logger="pdxfer"):
        took, errors = r.load(req, blocks)
    stats = r.worker.stats.take()
    rounds = r.worker.round_log
    assert [(x["round"], x["failed"], x["valid"]) for x in rounds] == [(0, True, True), (1, False, True)]
    assert victim in rounds[0]["incomplete"] and {rd["node"] for rd in rounds[1]["reads"]} == {other}
    assert repull_violations({"rounds": rounds, "blocks": blocks, "block_size": rblock, "hit": hit}) == []
    assert not errors, f"blocks recomputed: {sorted(errors)}"
    assert r.bad_tokens(0, blocks, hit) == 0
    assert stats["loads_ok"] == 1 and stats["loads_failed"] == 0 and stats["tokens_loaded"] == hit
    assert stats["repulls"] == CHUNKS + 0  # every chunk (the tail is not published here) came from the other
    assert took < LOAD_TIMEOUT_S + 0.5, f"the load took {took:.2f} s"
    named = [m for m in caplog.messages if "re-pulling" in m]
    assert named and f"from holder(s) {other} instead of {victim}" in named[0], caplog.messages


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_no_other_holder_recomputes_within_the_bound(holders, reader, how):
    start, procs = holders
    start("hc", 32, [3])
    r = reader(32)
    req, blocks, hit, victim = r.lookup(3)
    took, errors = r.load(req, blocks)
    assert not errors
    r.worker.stats.take()
    req, blocks, hit, victim = r.lookup(3)
    _fault(procs[victim], how)
    took, errors = r.load(req, blocks)
    stats = r.worker.stats.take()
    assert errors == set(blocks[: -(-hit // 32)]), "every block of the load is recomputed"
    assert stats["repulls"] == 0 and stats["loads_failed"] == 1
    assert took < LOAD_TIMEOUT_S + 0.5, f"the load took {took:.2f} s"


def test_history_checker_catches_a_late_repull(holders, reader, monkeypatch):
    """A re-pull that starts one block after the failed read's first block: that block keeps
    bytes the failed holder's read was to write; the history checker must report it (and the KV
    shows it)."""
    from pdxfer.vllm.worker import repull

    right = repull.restart_token
    monkeypatch.setattr(repull, "restart_token", lambda rp, reads, inc, bs: right(rp, reads, inc, bs) + bs)
    start, procs = holders
    start("ha", 32, [0])
    start("hb", 32, [0])
    r = reader(32)
    req, blocks, hit, victim = r.lookup(0)
    _fault(procs[victim], "kill")
    r.worker.round_log = []
    _, errors = r.load(req, blocks)
    assert not errors  # the broken re-pull believes it loaded everything
    found = repull_violations({"rounds": r.worker.round_log, "blocks": blocks, "block_size": 32, "hit": hit})
    assert [v["block"] for v in found] == [0] and found[0]["kind"] == "repull_invalid_source", found
    assert found[0]["writers"] == [{"node": victim, "round": 0, "counts": False}]
    assert r.bad_tokens(0, blocks, hit) == 32


def test_history_checker_mixed_block_rule():
    """Two holders in one block: fine when both counted, an error when one did not."""
    def rec(valid0: bool, incomplete0: list[str]) -> dict:
        rounds = [{"round": 0, "valid": valid0, "failed": bool(incomplete0), "incomplete": incomplete0,
                   "reads": [{"node": "a", "local": [], "staged": True, "start": 0, "tokens": 48},
                             {"node": "c", "local": [], "staged": True, "start": 48, "tokens": 16}]},
                  {"round": 1, "valid": True, "failed": False, "incomplete": [],
                   "reads": [{"node": "b", "local": [], "staged": True, "start": 16, "tokens": 32}]}]
        return {"rounds": rounds, "blocks": [7, 9], "block_size": 32, "hit": 64}

    assert repull_violations(rec(True, [])) == []  # a, b and c all counted
    got = repull_violations(rec(True, ["a"]))  # a's tokens 0-15 were not overwritten by b
    assert [(v["kind"], v["block"]) for v in got] == [("repull_mixed_block", 0)]
    got = repull_violations(rec(False, []))  # round 0's lock refused: c's tokens 48-63 do not count
    assert [(v["kind"], v["block"]) for v in got] == [("repull_mixed_block", 0), ("repull_mixed_block", 1)]
