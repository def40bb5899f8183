"""Which blocks hold which tokens: a chunk's token range as block ids of a given block size
(:func:`chunk_span`), and how many blocks a number of chunks takes."""

from __future__ import annotations

from dataclasses import dataclass

from pdxfer.kv.layout import LayoutError


def blocks_for_tokens(start: int, end: int, block_size: int) -> range:
    """Block indices (within a request's block table) that hold tokens ``[start, end)``."""
    if block_size <= 0:
        raise LayoutError(f"block_size must be positive, got {block_size}")
    if start < 0 or end < start:
        raise LayoutError(f"token range [{start}, {end}) is invalid")
    if start == end:
        return range(0)
    return range(start // block_size, (end - 1) // block_size + 1)


@dataclass(frozen=True)
class ChunkSpan:
    """Where chunk ``chunk`` lives in a request's block table."""

    chunk: int
    first_block: int
    num_blocks: int
    chunks_per_block: int  # > 1 when one block holds several chunks: the block moves as a whole


def chunk_span(chunk: int, chunk_tokens: int, block_size: int) -> ChunkSpan:
    """Map a chunk to blocks, for block sizes that divide or are a multiple of ``chunk_tokens``.

    Any other ratio would put a chunk boundary inside a block whose inner token order pdxfer
    cannot assume, so it is refused.
    """
    if chunk < 0:
        raise LayoutError(f"chunk index must be >= 0, got {chunk}")
    if chunk_tokens <= 0 or block_size <= 0:
        raise LayoutError(f"chunk_tokens and block_size must be positive, got {chunk_tokens}, {block_size}")
    if chunk_tokens % block_size == 0:
        per = chunk_tokens // block_size
        return ChunkSpan(chunk, chunk * per, per, 1)
    if block_size % chunk_tokens == 0:
        per = block_size // chunk_tokens
        return ChunkSpan(chunk, chunk // per, 1, per)
    raise LayoutError(f"block_size {block_size} neither divides nor is a multiple of chunk_tokens "
                      f"{chunk_tokens}; pick a chunk size that is a multiple or divisor of the block size")


def blocks_for_chunks(num_chunks: int, chunk_tokens: int, block_size: int) -> int:
    """How many leading blocks of a block table hold exactly ``num_chunks`` whole chunks.

    When a block spans several chunks only whole blocks count, so the chunk count is rounded
    down to a block boundary.
    """
    span = chunk_span(0, chunk_tokens, block_size)
    if span.chunks_per_block == 1:
        return num_chunks * span.num_blocks
    return num_chunks // span.chunks_per_block
