"""Issue 11: real prefill and decode instances with different KV block sizes, both directions.

The decode reads the prefill's whole blocks into its staging area and scatters the tokens into
its own blocks (pdxfer.convert, native kernels): its top-k logprobs equal the producer's own, and
it loaded every prompt token but the last (the pair oracle, conftest); loads corrupted on purpose
after the scatter fail that oracle.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import assert_oracle_catches_corruption, decode_loads_all_but_last, make_pair

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=[(128, 64), (64, 256), (256, 32)], ids=lambda p: f"P{p[0]}-D{p[1]}")
def pair(request, tmp_path_factory, tiny_model):
    p_bs, d_bs = request.param
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", prefill_args=("--block-size", str(p_bs)),
                         decode_args=("--block-size", str(d_bs)))


def test_decode_with_another_block_size_answers_like_plain(pair):
    decode_loads_all_but_last(pair, [(700, 31), (1500, 32)], MAX_TOKENS)
    assert pair.failed_loads() == 0


def test_the_oracle_catches_corrupted_converted_loads(pair):
    assert_oracle_catches_corruption(pair, 700, seed=3200, max_tokens=MAX_TOKENS)
