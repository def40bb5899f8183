"""The heterogeneous chaos holder (``ChaosConfig.kv``): the holder rules of
:mod:`tests.chaos.holder_proc`, over a real KV cache in one vLLM format and block size
(:func:`tests.chaos.kv.holder_side`), published the way a vLLM prefill holds it.

A publish is one request: prompt p's first n chunks laid out in the request's own blocks (token t
in block ``t // block_size``). A chunk this holder already holds keeps its blocks; a request block
that any new chunk covers is a fresh block with this request's KV, as vLLM's prefix cache shares
only whole blocks. So with blocks larger than a chunk, two prompts sharing one chunk hold it in
the first prompt's block while the second prompt's next chunk sits in another block: chunk
locations of one holder need not continue each other.
"""

from __future__ import annotations

from typing import Any

from pdxfer.master import NodeInfo
from pdxfer.transport.base import RegisteredRegion
from tests.chaos import kv
from tests.chaos.common import ChaosConfig, OpLog
from tests.chaos.holder_proc import Held, Holder


class KVHolder(Holder):
    MOVES = False  # its chunks are pattern-written KV across shared blocks

    def __init__(self, cfg: ChaosConfig, holder: int, node_id: str, inc: int, log: OpLog, master: str) -> None:
        self.side = kv.holder_side(holder % 100)  # a clash process (100 + i) has the format of the node it clashes with
        super().__init__(cfg, holder, node_id, inc, log, master)

    def _memory(self, node_id: str) -> NodeInfo:
        cfg, side = self.cfg, self.side
        nblocks = max(8, cfg.blocks * cfg.chunk_tokens // side.block_size)
        self.phys, self.caches, self.layout = kv.new_cache(side, nblocks)
        self.free = list(range(nblocks))
        self.refs: dict[int, int] = {}  # block -> held keys whose location names it
        self.transport.register([RegisteredRegion(r.index, r.ptr, r.nbytes, r.device) for r in self.layout.regions])
        return NodeInfo(node_id, 0, cfg.transport, self.transport.metadata(), self.layout.to_wire(),
                        self.layout.fingerprint(), total_kv_heads=kv.HEADS)

    def key(self, name: str) -> bytes:
        return bytes.fromhex(name)

    def _entry(self, k: str) -> Any:
        return list(self.held[k].block)

    def _return_blocks(self, h: Held) -> None:
        for b in h.block:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free.append(b)

    def _take_blocks(self, p: int, n: int, now: float, retain: float) -> tuple[list[tuple[str, Any, int]], list[str]]:
        cfg, C, hb = self.cfg, self.cfg.chunk_tokens, self.side.block_size
        keys = kv.chunk_keys(cfg.seed, p, cfg.chunks, C)
        tokens = kv.prompt_tokens(cfg.seed, p, cfg.chunks, C)

        def span(c: int) -> range:  # request blocks chunk c covers
            return range(c * C // hb, -(-(c + 1) * C // hb))

        # The longest n' <= n whose fresh blocks fit in what is free.
        while n > 0:
            fresh = sorted({j for c in range(n) if keys[c] not in self.held for j in span(c)})
            if len(fresh) <= len(self.free):
                break
            n -= 1
        if n == 0:
            return [], []
        blocks: dict[int, int] = {}
        for j in fresh:
            b = blocks[j] = self.free.pop(self.rng.randrange(len(self.free)))
            kv.write_block(self.phys, self.side, b, tokens, j * hb, min((j + 1) * hb, n * C))
        entries: list[tuple[str, Any, int]] = []
        new: list[str] = []
        for c in range(n):
            name = keys[c]
            h = self.held.get(name)
            if h is not None:  # held already: refreshed where it is
                h.retain_until, h.retention_end = now + retain, 0.0
                entries.append((name, list(h.block), h.gen))
                continue
            loc = tuple(blocks[j] for j in span(c))
            for b in loc:
                self.refs[b] = self.refs.get(b, 0) + 1
            self.gen += 1
            self.log.write("write", key=name, blocks=list(loc), gen=self.gen, holder=self.holder, inc=self.inc,
                           prompt=p, chunk=c)
            h = Held(loc, self.gen, now + retain)  # type: ignore[arg-type]  # a tuple of blocks here
            if cfg.unsafe_free:
                h.early_free_at = now + self.rng.uniform(0.0, retain)
            self.held[name] = h
            entries.append((name, list(loc), self.gen))
            new.append(name)
        return entries, new
