"""Issue 11: real prefill and decode instances with different KV block sizes, both directions.

The decode reads the prefill's whole blocks into its staging area and scatters the tokens into
its own blocks (pdxfer.convert, native kernels): its greedy answer equals the producer's own, and
it loaded every prompt token but the last.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import complete, make_pair, prompt_of, wait_metric

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=[(128, 64), (64, 256), (256, 32)], ids=lambda p: f"P{p[0]}-D{p[1]}")
def pair(request, tmp_path_factory, tiny_model):
    p_bs, d_bs = request.param
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", prefill_args=("--block-size", str(p_bs)),
                         decode_args=("--block-size", str(d_bs)))


def test_decode_with_another_block_size_answers_like_plain(pair):
    for n_tokens, seed in ((700, 31), (1500, 32)):
        prompt = prompt_of(n_tokens, seed=seed)
        ref = complete(pair.prefill_port, prompt, MAX_TOKENS)  # the producer alone
        complete(pair.prefill_port, prompt, 1)  # the proxy's prefill step: publishes the prompt's tail
        before = pair.loaded_tokens()
        assert complete(pair.decode_port, prompt, MAX_TOKENS) == ref
        got = wait_metric(pair.decode_port, "vllm:pdxfer_tokens_loaded_total", before + n_tokens - 1) - before
        assert got == n_tokens - 1
    assert pair.failed_loads() == 0
