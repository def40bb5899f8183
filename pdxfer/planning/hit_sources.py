"""Which holder block serves each token of a hit, when holders' block sizes differ from the
reader's (or from each other's): token-range reads that never load another request's KV.

Why the last chunk wins: keys are a chain hash, so the holder request found under chunk ``i``'s
key shares the reader's prompt through the end of chunk ``i``. Its blocks listed for chunk ``i``
therefore hold correct KV for every token from the first of those blocks up to that chunk's end,
earlier chunks' tokens included. A block listed by an earlier chunk may belong to a request that
parted right after that chunk (a holder block larger than a chunk holds the tokens after it too),
so each token is taken from the *last* chunk whose blocks reach back to it.

Reads come in two kinds, and the reader's worker executes them differently:
- whole blocks (the holder's block size is the reader's): every token of the reader block is
  written, so such a read may only cover reader blocks whose tokens it serves entirely (or whose
  rest lies past the hit's end, which vLLM computes itself);
- staged token ranges (another block size): exactly the range's tokens are written, so two of
  them may share a reader block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdxfer.kv.chunks import chunk_span
from pdxfer.kv.layout import LayoutError


@dataclass(frozen=True)
class ChunkPlace:
    """Where one chunk of a hit lives: a holder node, its block size, the blocks holding the chunk."""

    node_id: str
    block_size: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` are served from ``node_id``'s blocks ``block_ids``, whose first
    holds the tokens from ``first_token`` (a multiple of ``block_size``)."""

    node_id: str
    block_size: int
    first_token: int
    block_ids: tuple[int, ...]
    start: int
    end: int

    def blocks_for(self, s: int, e: int) -> tuple[int, tuple[int, ...]]:
        """(first token of the first block, the blocks) that hold tokens ``[s, e)`` of this piece."""
        hb = self.block_size
        skip = (s - self.first_token) // hb
        return self.first_token + skip * hb, self.block_ids[skip: -(-(e - self.first_token) // hb)]


def hit_pieces(first_chunk: int, places: Sequence[ChunkPlace], chunk_tokens: int,
               tail_tokens: int = 0) -> list[Piece]:
    """Pieces covering the hit of chunks ``first_chunk ..`` (in token order, disjoint, contiguous
    from the first chunk's first holder block); with ``tail_tokens`` > 0 the last place is a
    prompt's partial last chunk of that many tokens."""
    C = chunk_tokens
    spans = []
    for i, p in enumerate(places):
        tok0 = (first_chunk + i) * C
        tok1 = tok0 + (tail_tokens if tail_tokens and i == len(places) - 1 else C)
        hb = p.block_size
        if hb <= 0 or not (C % hb == 0 or hb % C == 0):
            raise LayoutError(f"holder {p.node_id} has block size {hb}, which neither divides nor is a "
                              f"multiple of chunk_tokens {C}")
        want = -(-tok1 // hb) - tok0 // hb
        if len(p.block_ids) != want:
            raise LayoutError(f"chunk {first_chunk + i} on {p.node_id} has {len(p.block_ids)} holder blocks, "
                              f"expected {want} (block size {hb}, tokens [{tok0}, {tok1}))")
        spans.append((p, tok0 // hb * hb, tok1))
    pieces: list[Piece] = []
    covered_from = spans[-1][2] if spans else 0
    for p, first_tok, _tok1 in reversed(spans):
        # This chunk's blocks are valid from their first token up to its end; later chunks
        # already serve everything from ``covered_from`` on.
        if first_tok < covered_from:
            ids = tuple(int(b) for b in p.block_ids[: -(-(covered_from - first_tok) // p.block_size)])
            pieces.append(Piece(p.node_id, p.block_size, first_tok, ids, first_tok, covered_from))
            covered_from = first_tok
    pieces.reverse()
    return _merged(pieces)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of one holder whose blocks continue each other become one."""
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if q is not None and q.node_id == p.node_id and q.block_size == p.block_size and q.end == p.start:
            q_next = q.first_token + len(q.block_ids) * q.block_size
            if p.first_token == q_next:
                ids = q.block_ids + p.block_ids
            elif p.first_token == q_next - q.block_size and p.block_ids[0] == q.block_ids[-1]:
                ids = q.block_ids + p.block_ids[1:]  # the same block continues
            else:
                out.append(p)
                continue
            out[-1] = Piece(q.node_id, q.block_size, q.first_token, ids, q.start, p.end)
            continue
        out.append(p)
    return out


def servable_end(pieces: Sequence[Piece], start: int, end: int, block_size: int) -> int:
    """The largest ``e <= end`` such that tokens ``[start, e)`` can be loaded exactly into reader
    blocks of ``block_size``: a whole-block piece (holder block size = ``block_size``) that ends
    inside a reader block before ``end`` would write that block's later tokens from a block that
    does not hold them (and race the read that does), so the hit stops at that block's start."""
    bs = block_size
    for p in pieces:
        s, e = max(start, p.start), min(end, p.end)
        if e <= s:
            continue
        if p.block_size == bs and (s % bs or (e % bs and e < end)):
            return max(start, (s if s % bs else e) // bs * bs)
    return end


@dataclass(frozen=True)
class TokenRead:
    """One read of a load plan: holder blocks -> reader blocks. ``staged``: write exactly tokens
    ``[start, end)`` (holder blocks from token ``remote_first_token``, reader blocks from
    ``local_first_token``); else block ``remote_blocks[i]`` whole into ``local_blocks[i]``, and
    ``[start, end)`` only spans the tokens those blocks serve (other reads may serve some between)."""

    node_id: str
    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    staged: bool
    remote_block_size: int
    remote_first_token: int
    local_first_token: int
    start: int
    end: int


def token_reads(pieces: Sequence[Piece], start: int, end: int, local_blocks: Sequence[int],
                block_size: int) -> list[TokenRead]:
    """Reads loading tokens ``[start, end)`` into the request's block table ``local_blocks``
    (reader blocks of ``block_size``); ``end`` must be at most :func:`servable_end`. Whole-block
    reads of one holder are joined into one read."""
    bs = block_size
    if servable_end(pieces, start, end, bs) < end:
        raise LayoutError(f"tokens [{start}, {end}) cannot be loaded exactly into blocks of {bs} from these holders")
    if -(-end // bs) > len(local_blocks):
        raise LayoutError(f"tokens up to {end} need {-(-end // bs)} reader blocks, the request has {len(local_blocks)}")
    reads: list[TokenRead] = []
    whole: dict[str, int] = {}  # node -> index of its whole-block read in ``reads``
    done = start
    for p in pieces:
        s, e = max(start, p.start), min(end, p.end)
        if e <= s:
            continue
        if s != done:
            raise LayoutError(f"tokens [{done}, {s}) have no holder block in the hit")
        done = e
        rft, remote = p.blocks_for(s, e)
        lb0 = s // bs
        local = tuple(int(b) for b in local_blocks[lb0: -(-e // bs)])
        if p.block_size != bs:
            reads.append(TokenRead(p.node_id, remote, local, True, p.block_size, rft, lb0 * bs, s, e))
            continue
        at = whole.get(p.node_id)
        if at is None:
            whole[p.node_id] = len(reads)
            reads.append(TokenRead(p.node_id, remote, local, False, bs, 0, 0, s, e))
        else:
            r = reads[at]
            reads[at] = TokenRead(r.node_id, r.remote_blocks + remote, r.local_blocks + local, False, bs, 0, 0,
                                  r.start, e)
    if done != end:
        raise LayoutError(f"tokens [{done}, {end}) have no holder block in the hit")
    return reads


def pair_hit_blocks(first_chunk: int, chunk_holders: Sequence[tuple[str, Sequence[int]]], chunk_tokens: int,
                    block_size: int, start: int, end: int, local_blocks: Sequence[int],
                    tail_tokens: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """Per holder node, (holder block ids, reader block ids) covering tokens ``[start, end)``.

    ``chunk_holders[i]`` is (node id, that holder's block ids) of chunk ``first_chunk + i``; with
    ``tail_tokens`` > 0 the last entry is a prompt's partial last chunk of that many tokens.
    ``local_blocks`` is the reader request's whole block table. ``start`` must be block aligned;
    an ``end`` inside a block copies that block whole: the caller computes the tokens past
    ``end`` itself and never uses those bytes (that is how the prompt's last token is left out).
    """
    bs = block_size
    hit_end = (first_chunk + len(chunk_holders) - (1 if tail_tokens else 0)) * chunk_tokens + tail_tokens
    if start % bs or start < first_chunk * chunk_tokens or end < start or end > hit_end:
        raise LayoutError(f"token range [{start}, {end}) is not block aligned or lies outside the hit "
                          f"[{first_chunk * chunk_tokens}, {hit_end})")
    if tail_tokens and not 0 < tail_tokens < chunk_tokens:
        raise LayoutError(f"a tail has 1 to {chunk_tokens - 1} tokens (chunk_tokens {chunk_tokens}), "
                          f"got {tail_tokens}")
    remote_of: dict[int, tuple[str, int]] = {}
    for i, (node_id, ids) in enumerate(chunk_holders):
        span = chunk_span(first_chunk + i, chunk_tokens, bs)
        is_tail = tail_tokens and i == len(chunk_holders) - 1
        want = -(-tail_tokens // bs) if is_tail else span.num_blocks
        if len(ids) != want:
            what = f"tail of chunk {first_chunk + i}" if is_tail else f"chunk {first_chunk + i}"
            raise LayoutError(f"{what} has {len(ids)} holder blocks, expected {want}")
        # A later chunk listing the same block replaces the earlier one: keys are a chain hash, so
        # that block holds this prompt's KV through the later chunk's end, while the earlier
        # chunk's block may belong to a request that parted right after that chunk.
        for j, rb in enumerate(ids):
            remote_of[span.first_block + j] = (node_id, int(rb))
    last = -(-end // bs)
    if last > len(local_blocks):
        raise LayoutError(f"tokens up to {end} need {last} reader blocks, the request has {len(local_blocks)}")
    per_node: dict[str, tuple[list[int], list[int]]] = {}
    for tb in range(start // bs, last):
        if tb not in remote_of:
            raise LayoutError(f"block {tb} of the token range has no holder block in the hit")
        node_id, rb = remote_of[tb]
        remote, local = per_node.setdefault(node_id, ([], []))
        remote.append(rb)
        local.append(int(local_blocks[tb]))
    return per_node
