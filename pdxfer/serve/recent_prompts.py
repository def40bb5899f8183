"""Which prompt prefixes each instance's own prefix cache likely holds, from what was routed there.

The master's index is exact but chunk-granular (a 256-token chunk is published once it is whole):
two decode instances that both hold a shared system prompt's chunks tie, although only one of
them served this conversation's previous turn and still holds it in its prefix cache, block by
block. This table remembers, per instance, the hash-chained block prefixes of the prompts routed
to it (as llm-d's approximate prefix scorer does) so the router can break such ties and count what
the chosen decode computes locally; the index stays the authority on what can be *loaded*.

An estimate, never a promise: an instance may have evicted a block, and a wrong guess costs only
a slower request (the decode computes what it lacks). Bounded: at most ``capacity_tokens`` per
instance, least recently routed blocks forgotten first (the tail of a prompt before its head, as
vLLM's prefix cache evicts), and an instance's whole history is dropped when it is taken out
(it may come back restarted, with an empty cache).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def block_chain(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """One hash per full block of ``tokens``, each over its block and all blocks before it."""
    chain: list[int] = []
    h = 0
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(tokens[i:i + block_tokens])))
        chain.append(h)
    return chain


class RecentPrompts:
    """Not thread-safe: used from the proxy's event loop only."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must not be negative, got {capacity_tokens}")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._by_url: dict[str, OrderedDict[int, None]] = {}

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    def chain(self, tokens: Sequence[int]) -> list[int]:
        return block_chain(tokens, self.block_tokens) if self.enabled else []

    def longest_prefix(self, url: str, chain: Sequence[int]) -> int:
        """Leading tokens of the prompt with block ``chain`` last routed to ``url``."""
        blocks = self._by_url.get(url)
        if not blocks:
            return 0
        n = 0
        for h in chain:
            if h not in blocks:
                break
            n += 1
        return n * self.block_tokens

    def record(self, url: str, chain: Sequence[int]) -> None:
        """``url`` was sent the prompt with block ``chain``: its prefix cache now holds it."""
        if not self.enabled or not chain:
            return
        blocks = self._by_url.setdefault(url, OrderedDict())
        # Head last: it is the most recently used, so the tail goes first when room runs out.
        for h in reversed(chain[:self.capacity_blocks]):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def forget(self, url: str) -> None:
        self._by_url.pop(url, None)

    def blocks(self, url: str) -> int:
        return len(self._by_url.get(url, ()))

    def total_blocks(self) -> int:
        return sum(len(b) for b in self._by_url.values())
