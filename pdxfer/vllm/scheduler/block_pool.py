"""pdxfer's references on vLLM ``BlockPool`` blocks: how a holder keeps published blocks
allocated without vLLM's delayed free (scheduler thread only: the pool is not thread-safe)."""

from __future__ import annotations

from typing import Any, Sequence


class BlockPoolHolder:
    """Takes and drops pdxfer's references on vLLM ``BlockPool`` blocks (scheduler thread only)."""

    def __init__(self, pool: Any):
        self.pool = pool

    @property
    def num_blocks(self) -> int:
        return int(self.pool.num_gpu_blocks)

    @property
    def null_block_id(self) -> int:
        """The block vLLM puts in a block table where a group needs none (a sliding window's
        freed blocks)."""
        return int(self.pool.null_block.block_id)

    def hold(self, block_ids: Sequence[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in block_ids])

    def unhold(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks([self.pool.blocks[b] for b in block_ids])
