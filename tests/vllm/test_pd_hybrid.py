"""Hybrid models on real ``vllm serve`` instances with vLLM's hybrid KV cache manager (HMA) on.

A pair of the tiny sliding-window model (Gemma 3 style: window 128 on 4 of 6 layers, float32;
vLLM makes three KV cache groups of two layers: sliding, sliding, full) moves every group: the
decode's answers equal the producer's own to the top-5 logprobs, every prompt token but the last
is loaded, and the sliding groups move only the window before the hit. Beside it, started at the
same time: a plain instance of that model (whose KV cache capacity the pair's instances must
match) and a pdxfer instance of the tiny gated-delta-net model (Qwen3-Next style), whose state
groups pdxfer does not move: it must start with HMA on and serve, saying why it moves no KV.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdxfer.common.procs import free_port, wait_http_ready
from pdxfer.launch.plan import pdxfer_kv_config
from pdxfer.launch.serve_shim import start_vllm
from pdxfer.launch.tiny_model import default_tiny_model_dir, make_tiny_model
from tests.vllm.conftest import (PAIR_VLLM_ARGS, READY_TIMEOUT_S, ask, assert_oracle_catches_corruption, check_logprobs,
                                 make_pair, metrics, pair_oracle, post_json, prompt_of, stop_all, through_pair)

WINDOW = 128
_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
_BLOCK_BYTES = re.compile(r"registered \d+ KV region\(s\), \d+ blocks x (\d+) bytes")
HMA_OFF = "Turning off hybrid kv cache manager"

pytestmark = pytest.mark.vllm


def _capacity(log: Path) -> int:
    found = _CAPACITY.findall(log.read_text(errors="replace"))
    assert found, f"{log} names no KV cache capacity"
    return int(found[-1].replace(",", ""))


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory):
    """The plain sliding instance and the pdxfer GDN instance, started before the pair so the
    three start-ups overlap; the plain one stops as soon as its capacity is read."""
    run = tmp_path_factory.mktemp("hybrid-others")
    sliding = make_tiny_model(default_tiny_model_dir("sliding"), arch="sliding")
    gdn = make_tiny_model(default_tiny_model_dir("gdn"), arch="gdn")
    plain_port, gdn_port = free_port(), free_port()
    plain = start_vllm(sliding, plain_port, None, cpu_bind="0", log_dir=run, name="plain-sliding",
                       extra_args=PAIR_VLLM_ARGS)
    # No master is needed: pdxfer refuses the GDN model's groups before it would connect.
    gdn_cfg = pdxfer_kv_config("kv_both", "127.0.0.1:1", "tcp")
    gdn_proc = start_vllm(gdn, gdn_port, gdn_cfg, cpu_bind="1", log_dir=run, name="gdn-pdxfer",
                          extra_args=("--dtype", "bfloat16", "--max-model-len", "4096"))
    try:
        yield {"sliding": sliding, "plain": plain, "plain_port": plain_port, "gdn": gdn_proc, "gdn_port": gdn_port}
    finally:
        stop_all([plain, gdn_proc])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, others):
    yield from make_pair(tmp_path_factory, others["sliding"], "tcp")


def _stat(port: int, name: str) -> float:
    return metrics(port).get(f"vllm:pdxfer_{name}_total", 0.0)


def test_hma_stays_on_and_the_kv_cache_holds_what_a_plain_instances_does(pair, others):
    wait_http_ready(f"http://127.0.0.1:{others['plain_port']}/health", READY_TIMEOUT_S, others["plain"])
    plain = _capacity(others["plain"].log_path)
    for proc in (pair.prefill, pair.decode):
        text = proc.log_path.read_text(errors="replace")
        assert HMA_OFF not in text
        assert "moves KV cache groups [sliding128,sliding128,full] (hybrid KV cache manager on)" in text
        assert _capacity(proc.log_path) == plain, f"{proc.log_path}: {_capacity(proc.log_path)} tokens vs plain {plain}"
    others["plain"].stop(15)  # frees its core for the loads below


@pytest.mark.parametrize("n_tokens", [200, 700, 2500])
def test_the_decode_loads_every_group_and_answers_as_the_producer(pair, n_tokens):
    pair_oracle(pair, prompt_of(n_tokens, seed=n_tokens), 4)


def test_the_sliding_groups_move_only_the_window(pair):
    n = 2500
    block_bytes = int(_BLOCK_BYTES.findall(pair.decode.log_path.read_text(errors="replace"))[-1])
    before = {k: _stat(pair.decode_port, k) for k in ("bytes_loaded_full", "bytes_loaded_sliding", "bytes_loaded")}
    pair_oracle(pair, prompt_of(n, seed=99), 2)
    after = {k: _stat(pair.decode_port, k) for k in before}
    bs = 128  # vLLM's CPU block size for this model
    hit = n - 1
    full_blocks = -(-hit // bs)
    # Attention at the first computed token reads [hit - WINDOW + 1, hit]: blocks from there on.
    window_blocks = full_blocks - (hit - WINDOW + 1) // bs
    assert after["bytes_loaded_full"] - before["bytes_loaded_full"] == full_blocks * block_bytes
    assert after["bytes_loaded_sliding"] - before["bytes_loaded_sliding"] == 2 * window_blocks * block_bytes
    moved = after["bytes_loaded"] - before["bytes_loaded"]
    assert moved == (full_blocks + 2 * window_blocks) * block_bytes
    # Without the groups every layer's full length would move: three times the full group's bytes.
    print(f"hybrid load of {hit} tokens: {moved / 2**20:.2f} MiB, {moved / (3 * full_blocks * block_bytes):.2f}x "
          "of every layer's full length")


def test_planted_corruption_in_any_group_fails_the_oracle(pair):
    assert_oracle_catches_corruption(pair, 700, seed=500, max_tokens=4,
                                     modes=("zero_window", "shift", "zero_layer", "other"))


def test_a_gdn_hybrid_starts_with_hma_on_and_serves_without_kv_transfer(others):
    wait_http_ready(f"http://127.0.0.1:{others['gdn_port']}/health", READY_TIMEOUT_S, others["gdn"])
    out = post_json(f"http://127.0.0.1:{others['gdn_port']}/v1/completions",
                    {"model": "tiny", "prompt": prompt_of(300, seed=3), "max_tokens": 3, "temperature": 0})
    assert len(out["choices"][0]["text"]) > 0
    text = others["gdn"].log_path.read_text(errors="replace")
    assert HMA_OFF not in text and "Failed to promote" not in text
    assert "KV transfer is off for engine" in text and "recurrent state such as Mamba or gated delta-net" in text
    assert metrics(others["gdn_port"]).get("vllm:pdxfer_kv_transfer_refused_total", 0.0) == 1.0


def test_a_failed_hybrid_load_is_recomputed_whole_and_the_engine_goes_on(pair):
    """vLLM cannot map block ids of several groups back to requests (it stops the engine if a
    connector reports them): a hybrid load that fails is reported by request and recomputed."""
    prompt = prompt_of(700, seed=777)
    ref = ask(pair.prefill_port, prompt, 4)
    failed = pair.failed_loads()
    pair.set_hook("lock_ttl_s", 0.5)
    pair.set_hook("read_delay_s", 1.0)  # the lock expires before the read ends: validation fails
    try:
        got = through_pair(pair, prompt, 4)
    finally:
        pair.set_hook("lock_ttl_s", None)
        pair.set_hook("read_delay_s", None)
    own = pair.request_loads(got.request_id, until=lambda r: bool(r.failed))
    assert own.failed == [699] and not own.loaded, own
    assert got.cached_tokens == 0  # recomputed whole, every group
    check_logprobs(got, ref)
    assert pair.failed_loads() >= failed + 1
    pair_oracle(pair, prompt_of(500, seed=778), 4)  # the engine loads again afterwards
