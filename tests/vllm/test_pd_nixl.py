"""Real prefill -> decode through pdxfer over the NIXL (UCX) transport: same output as the
instance computing everything, and the decode really read the prefix. The fault paths are
transport-independent (scheduler/worker logic) and covered over TCP in test_pd_tcp.py, except
a dead NIXL holder, which is checked here last.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl_cu12")

from tests.vllm.conftest import complete, make_pair, prompt_of, wait_metric  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "nixl")


@pytest.mark.parametrize("n_tokens", [700, 2200], ids=["3-chunks", "8-chunks"])
def test_decode_output_equals_plain_and_skips_the_prefix(pair, n_tokens):
    prompt = prompt_of(n_tokens, seed=100 + n_tokens)
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    before = pair.loaded_tokens()
    complete(pair.prefill_port, prompt, 1)
    assert complete(pair.decode_port, prompt, MAX_TOKENS) == ref
    expected = n_tokens - 1  # every prompt token but the last
    got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + expected) - before
    assert got == expected


def test_dead_nixl_holder_means_recompute(pair):
    prompt = prompt_of(1000, seed=200)
    published = pair.published_at_master()
    ref = complete(pair.prefill_port, prompt, MAX_TOKENS)
    assert pair.wait_published(published + 4) >= published + 4  # 3 chunks and the tail, at the master
    failed = pair.failed_loads()
    pair.prefill.kill()
    t0 = time.monotonic()
    assert complete(pair.decode_port, prompt, MAX_TOKENS) == ref
    assert time.monotonic() - t0 < 30
    assert wait_metric(pair.decode_port, "vllm:pdxfer_loads_failed_total", failed + 1) == failed + 1
