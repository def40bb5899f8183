"""Holder blocks larger than a chunk, through both connector halves with real bytes: a real
master, vLLM's real BlockPool, the real TCP transport, staging and scatter. What the reader ends
up with is compared token by token against the KV the holder computed for that very prompt.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.unit.test_convert import D, H, tokens_kv  # noqa: E402
from tests.vllm.test_connector_flow import Node, _tokens  # noqa: E402

C = 64
HB = 128  # the holder's block: two chunks


def _set_tokens(cache: dict[str, torch.Tensor], block: int, bs: int, t0: int, t1: int, src: torch.Tensor) -> None:
    """Write ``src`` ([layers, 2, tokens, heads, dim], tokens_kv's shape) as tokens [t0, t1) of ``block``."""
    for li, name in enumerate(sorted(cache)):
        b = cache[name][block].view(H, 2 * bs * D)
        k = b[:, : bs * D].view(H, D, bs)
        v = b[:, bs * D:].view(H, bs, D)
        for t in range(t0, t1):
            k[:, :, t] = src[li, 0, t - t0]
            v[:, t, :] = src[li, 1, t - t0]


@pytest.fixture
def nodes(master):
    made: list[Node] = []

    def make(name: str, block_size: int, producer: bool, seed: int | None) -> Node:
        n = Node(name, master.address, producer, not producer, seed=seed, block_size=block_size,
                 chunk_tokens=C, max_held_fraction=0.9)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


@pytest.mark.parametrize("rb", [32, 128])
def test_two_prompts_sharing_one_chunk_of_a_holder_block_load_exactly(nodes, rb):
    """Issue 16 hole 1 with real bytes: R1 and R2 share exactly their first 64 tokens, both
    prefilled on a holder with blocks of 128; R2's decode reads tokens 0-127 from R2's block."""
    holder = nodes(f"h-share-{rb}", HB, True, 40 + rb)
    reader = nodes(f"r-share-{rb}", rb, False, None)
    r2 = _tokens(300, 41)
    r1 = r2[:C] + [t + 1 for t in r2[C:2 * C]] + _tokens(40, 42)
    h1 = holder.run_request("p1", r1)
    h2 = holder.run_request("p2", r2)
    # What a real prefill computes: R1's first 64 tokens have R2's KV, the rest differ.
    _set_tokens(holder.kv, h1[0], HB, 0, C, tokens_kv(holder.kv, h2, HB, 0, C))
    ext, r_ids, errors = reader.load("d", r2)
    assert ext == len(r2) - 1 and not errors
    assert torch.equal(tokens_kv(reader.kv, r_ids, rb, 0, ext), tokens_kv(holder.kv, h2, HB, 0, ext))


@pytest.mark.parametrize("rb", [32, 128])
@pytest.mark.parametrize("n", [16, 99, 150])
def test_a_tail_moves_when_holder_blocks_are_larger_than_the_chunk(nodes, rb, n):
    """The prompt's partial last chunk is published by a holder with blocks of 128 (C 64) and
    loaded into reader blocks of 32 and 128: every prompt token but the last."""
    holder = nodes(f"h-tail-{rb}-{n}", HB, True, 50 + n)
    reader = nodes(f"r-tail-{rb}-{n}", rb, False, None)
    toks = _tokens(n, 51 + n)
    h_ids, published = holder.finish("p", toks)
    assert published == n  # the hint covers the whole prompt, tail included
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == n - 1 and not errors
    assert torch.equal(tokens_kv(reader.kv, r_ids, rb, 0, ext), tokens_kv(holder.kv, h_ids, HB, 0, ext))
    assert reader.worker.stats.tokens_loaded == ext
