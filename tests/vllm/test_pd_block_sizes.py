"""Issue 11: real instances with different KV block sizes, KV moved both ways.

The reader reads the holder's whole blocks into its staging area and scatters the tokens into
its own blocks (pdxfer.planning.convert, native kernels): its top-k logprobs equal the holder's own, and
it loaded every prompt token but the last (the pair oracle, conftest); loads corrupted on purpose
after the scatter fail that oracle.

Each pair is kv_both on both sides, so one start-up tests two directions: (128, 64) moves KV
128 -> 64 and 64 -> 128, (256, 32) moves it 256 -> 32 and 32 -> 256 (a holder block of a whole
chunk split into eight, and eight reader-side blocks gathered into one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.vllm.conftest import PDPair, assert_oracle_catches_corruption, decode_loads_all_but_last, make_pair

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
# The corruption check resets the reading side's prefix cache (/reset_prefix_cache, a dev
# endpoint): both sides read here, so both serve it.
BOTH_READ_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# Prompt seeds of their own per pair and direction, used by no other test:
# - a prompt that already went one way is in both instances' prefix caches (a kv_both reader
#   keeps and publishes what it loaded), so the other direction would load nothing; corrupted
#   loads stay in the reader's cache too (a kv_both reader holds its blocks for readers, and
#   vLLM refuses to reset a cache with blocks in use: the reset answers success=false);
# - conftest.ask forwards the newest publish hint it saw for a prompt (same tokens) to every
#   later request of it, from any pair: a kv_both instance asked for a prompt with a hint of
#   chunks it cannot find (another pair's, or its own) waits publish_hint_wait_s (3 s) for them.
SEED_BASE = {(128, 64): 51000, (256, 32): 52000}
REVERSE_SEED = 500


def swapped(pair: PDPair) -> PDPair:
    """The same running kv_both pair seen the other way round: the decode instance holds (computes
    each prompt, is the oracle's reference) and the prefill instance reads. The conftest oracle
    reads the holder's port, the reader's port, log, TP ranks and metrics through these fields;
    the hooks directory is the pair's one (both instances watch it)."""
    if pair.prefill_role != "kv_both" or pair.decode_role != "kv_both":
        raise ValueError(f"only a kv_both pair reads both ways, not {pair.prefill_role} -> {pair.decode_role}")
    return dataclasses.replace(
        pair, prefill=pair.decode, decode=pair.prefill, prefill_port=pair.decode_port,
        decode_port=pair.prefill_port, prefill_args=pair.decode_args, decode_args=pair.prefill_args,
        prefill_bind=pair.decode_bind, decode_bind=pair.prefill_bind)


def both_ways_pair(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, **kw: Any) -> Iterator[PDPair]:
    """make_pair with both instances kv_both (each publishes and reads) and the dev endpoints on
    both sides."""
    env = {**BOTH_READ_ENV, **kw.pop("extra_env", {})}
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", prefill_role="kv_both", decode_role="kv_both",
                         extra_env=env, **kw)


@pytest.fixture(scope="module", params=list(SEED_BASE), ids=lambda p: f"P{p[0]}-D{p[1]}")
def sizes(request) -> tuple[int, int]:
    """(the prefill instance's block size, the decode instance's)."""
    return request.param


@pytest.fixture(scope="module")
def pair(sizes, tmp_path_factory, tiny_model):
    p_bs, d_bs = sizes
    yield from both_ways_pair(tmp_path_factory, tiny_model, prefill_args=("--block-size", str(p_bs)),
                              decode_args=("--block-size", str(d_bs)))


@pytest.fixture(params=["P-to-D", "D-to-P"])
def way(request, pair, sizes):
    """(the pair as the oracle sees it in this direction, the seed base of its prompts)."""
    if request.param == "P-to-D":
        return pair, SEED_BASE[sizes]
    return swapped(pair), SEED_BASE[sizes] + REVERSE_SEED


def test_decode_with_another_block_size_answers_like_plain(way):
    view, seeds = way
    decode_loads_all_but_last(view, [(700, seeds + 31), (1500, seeds + 32)], MAX_TOKENS)
    assert view.failed_loads() == 0


def test_the_oracle_catches_corrupted_converted_loads(way):
    view, seeds = way
    assert_oracle_catches_corruption(view, 700, seed=seeds + 200, max_tokens=MAX_TOKENS)
