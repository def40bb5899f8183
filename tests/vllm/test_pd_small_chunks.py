"""Issue 16, hole 1 and tails: real pairs whose holder block (128) is larger than the chunk (64
tokens), read by a decode of another block size (32), checked by the pair oracle (conftest).

Two prompts share exactly their first 64 tokens and are prefilled one after the other: the second
one's first chunk stays in the first one's block, its second chunk in a block of its own. A
decode that never saw the first prompt must load all of the second but its last token, and its
top-k logprobs must equal the producer's own: the tokens 64-127 of the other prompt's block are
not the second prompt's.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import (
    ask, assert_decode_right, check_logprobs, make_pair, pair_oracle, prompt_of, through_pair,
)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
CHUNK = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", prefill_args=("--block-size", "128"),
                         decode_args=("--block-size", "32"), extra_cfg={"chunk_tokens": CHUNK})


def test_whole_chunks_of_an_unshared_prompt_load_like_plain(pair):
    # 640 tokens: whole chunks and whole holder blocks, no tail.
    pair_oracle(pair, prompt_of(640, seed=4100), MAX_TOKENS)


def test_prompts_sharing_one_chunk_of_a_holder_block_load_their_own_tokens(pair):
    first = prompt_of(300, seed=4200)
    second = first[:CHUNK] + prompt_of(236, seed=4201)
    assert second[CHUNK] != first[CHUNK]  # they share exactly the first chunk
    ask(pair.prefill_port, first, 1)  # published; the decode never sees it
    ref = ask(pair.prefill_port, second, MAX_TOKENS)  # the producer computing all of it alone
    got = through_pair(pair, second, MAX_TOKENS)
    check_logprobs(got, ref)  # first: wrong KV (hole 1) is the worse failure, name it if it happens
    assert_decode_right(pair, got, ref, loaded=len(second) - 1)


@pytest.mark.parametrize("n_tokens", [16, 99, 1499])
def test_tails_move_with_a_holder_block_larger_than_the_chunk(pair, n_tokens):
    pair_oracle(pair, prompt_of(n_tokens, seed=4300 + n_tokens), MAX_TOKENS)
