"""The reader's lookup (issue 16, holes 7 and 8), through both connector halves, a real master
process and the real TCP transport.

Hole 7: a holder this reader cannot read (another block size without staging, itself) must not
hide one it can read that has the same chunks. Hole 8: a decode waiting for a hinted publish
waits at most ``publish_hint_wait_s`` and never on vLLM's scheduler thread.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdxfer.master import MasterClient  # noqa: E402
from tests.vllm.test_connector_flow import BS, C, Node, _same_blocks, _tokens  # noqa: E402


def _master_lookups(addr: str) -> int:
    with MasterClient(addr, timeout_s=5.0) as c:
        return int(c.stats()["lookups"])


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(*args, **kw) -> Node:
        n = Node(*args, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def test_an_unreadable_holder_does_not_hide_a_readable_one(master, nodes):
    # 'a' holds more of the prompt (the master's greedy pick) in blocks of 64: a reader without
    # staging cannot read them. 'b' holds the first two chunks in blocks like the reader's.
    unreadable = nodes("h7a", master.address, True, False, seed=91, block_size=64)
    readable = nodes("h7b", master.address, True, False, seed=92)
    reader = nodes("r7", master.address, False, True, seed=None, staging_mib=0)
    toks = _tokens(3 * C + 5, 90)
    unreadable.run_request("p", toks)
    b_ids = readable.run_request("q", toks[: 2 * C + 7])
    before = _master_lookups(master.address)
    ext, r_ids, errors = reader.load("d", toks)
    assert ext == 2 * C and not errors
    n = 2 * C // BS
    assert _same_blocks(readable, b_ids[:n], reader, r_ids[:n])
    # The first meeting costs one more lookup (the reader learns what it cannot read); later
    # lookups name that holder at once.
    assert _master_lookups(master.address) - before == 2
    toks2 = toks[:C] + _tokens(2 * C + 9, 93)
    unreadable.run_request("p2", toks2)
    readable.run_request("q2", toks2[: 2 * C + 3])
    before = _master_lookups(master.address)
    assert reader.load("d2", toks2)[0] == 2 * C
    assert _master_lookups(master.address) - before == 1


def test_a_kv_both_instance_reads_from_another_holder_not_itself(master, nodes):
    # Same chunks on both; ties go to the smaller node id, which is this instance's own.
    both = nodes("a7both", master.address, True, True, seed=94)
    other = nodes("b7other", master.address, True, False, seed=95)
    toks = _tokens(2 * C + 5, 96)
    both.run_request("p", toks)
    o_ids = other.run_request("q", toks)
    ext, ids, errors = both.load("d", toks)
    assert ext == len(toks) - 1 and not errors
    assert _same_blocks(other, o_ids[: 2 * C // BS], both, ids[: 2 * C // BS])

