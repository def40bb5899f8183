"""pdxfer.planning.hit_sources on its own: which holder blocks serve which tokens, and where a hit must stop."""

from __future__ import annotations

import pytest

from pdxfer.planning.hit_sources import ChunkPlace, Piece, hit_pieces, servable_end, token_reads
from pdxfer.kv.layout import LayoutError


def test_the_last_chunk_reaching_a_block_serves_all_of_it():
    # C 64, holder blocks 128: chunk 0 in block 7 (another request's), chunks 1-3 in 8, 8, 9.
    places = [ChunkPlace("h", 128, (7,)), ChunkPlace("h", 128, (8,)), ChunkPlace("h", 128, (8,)),
              ChunkPlace("h", 128, (9,))]
    assert hit_pieces(0, places, 64) == [Piece("h", 128, 0, (8, 9), 0, 256)]


def test_pieces_of_two_block_sizes_and_a_tail():
    # Chunk 0 on a (128), chunk 1 on b (32), chunk 2 on a, then a 10-token tail on b.
    places = [ChunkPlace("a", 128, (1,)), ChunkPlace("b", 32, (20, 21)), ChunkPlace("a", 128, (2,)),
              ChunkPlace("b", 32, (30,))]
    assert hit_pieces(0, places, 64, tail_tokens=10) == [
        Piece("a", 128, 0, (1,), 0, 64), Piece("b", 32, 64, (20, 21), 64, 128),
        Piece("a", 128, 128, (2,), 128, 192), Piece("b", 32, 192, (30,), 192, 202)]


def test_a_holder_that_lists_the_wrong_number_of_blocks_is_refused():
    with pytest.raises(LayoutError, match="chunk 1 on h has 2 holder blocks, expected 1"):
        hit_pieces(0, [ChunkPlace("h", 128, (1,)), ChunkPlace("h", 128, (1, 2))], 64)
    with pytest.raises(LayoutError, match="neither divides nor is a multiple"):
        hit_pieces(0, [ChunkPlace("h", 96, (1,))], 64)


def test_a_whole_block_piece_ending_inside_a_reader_block_stops_the_hit():
    pieces = [Piece("a", 128, 0, (1, 2), 0, 192), Piece("b", 32, 192, (5, 6), 192, 256)]
    assert servable_end(pieces, 0, 256, 128) == 128  # a's block 2 would be written whole
    assert servable_end(pieces, 0, 256, 32) == 256  # both staged at reader block 32
    assert servable_end(pieces, 0, 170, 128) == 170  # ends inside a's block at the hit's end: fine
    with pytest.raises(LayoutError, match="cannot be loaded exactly"):
        token_reads(pieces, 0, 256, list(range(10)), 128)
    reads = token_reads(pieces, 0, 128, list(range(10, 20)), 128)
    assert [(r.node_id, r.remote_blocks, r.local_blocks, r.staged) for r in reads] == [("a", (1,), (10,), False)]


def test_token_reads_stage_exact_ranges_and_join_whole_blocks_per_holder():
    # Reader blocks of 32; a's blocks (32) are read whole, b's (64) staged; tokens [0, 32) are local.
    places = [ChunkPlace("a", 32, (1, 2)), ChunkPlace("b", 64, (9,)), ChunkPlace("a", 32, (3, 4))]
    reads = token_reads(hit_pieces(0, places, 64), 32, 192, list(range(100, 106)), 32)
    assert [(r.node_id, r.remote_blocks, r.local_blocks, r.staged, r.start, r.end) for r in reads] == [
        ("a", (2, 3, 4), (101, 104, 105), False, 32, 192), ("b", (9,), (102, 103), True, 64, 128)]
    assert (reads[1].remote_first_token, reads[1].local_first_token) == (64, 64)
