"""Host-tier chunks read by a reader whose blocks differ from the holder's: a real master process, a
real TCP holder process with a host tier (pdxfer's HostPool, some chunks of the prompt served from
host slots, the others from its KV cache, in one load) and pdxfer's two connector halves in this
process. The reader reads both tiers through staging and converts (another block size: token
ranges split at the tier boundaries; another format: device and host pairs apart), and a reader
whose device route is direct but whose host route converts mixes the two. The loaded KV equals
the pattern token by token, nothing is recomputed, and the load counts as host-tier tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pdxfer.planning.convert import ConvertingPlanner  # noqa: E402
from pdxfer.kv.layout import CPU, FLASH_HND  # noqa: E402
from pdxfer.planning.peer_plan import PeerPlanner  # noqa: E402
from tests.vllm.test_repull import Reader, holders, master, reader  # noqa: E402,F401


def _load_checked(r: Reader, prompt: int, staged: bool) -> None:
    """Load ``prompt`` (some chunks on the holder's host tier, some in its KV cache): every token
    right, nothing recomputed, every loaded token counted as host tier."""
    r.worker.stats.take()
    req, blocks, hit, _ = r.lookup(prompt)
    _, errors = r.load(req, blocks)
    stats = r.worker.stats.take() or {}
    reads = [rd for spec in r.meta.loads for rd in spec.reads]
    _, n_device = r.worker.peers.host_planners[("h", 0)]
    ids = [b for rd in reads for b in rd.remote_blocks]
    assert min(ids) < n_device <= max(ids), f"the load names no blocks of both tiers: {reads}"
    assert all(bool(rd.remote_block_size) == staged for rd in reads), reads
    assert not errors, f"blocks recomputed: {sorted(errors)}"
    assert r.bad_tokens(prompt, blocks, hit) == 0
    assert stats["loads_ok"] == 1 and stats["loads_failed"] == 0 and stats["tokens_loaded"] == hit
    assert stats["host_tier_tokens_loaded"] == hit


# (holder block size, reader block size and format, the chunks served from host slots, token
# ranges): holder blocks of two chunks read as token ranges (device, two host slots, device); the
# same block size in another format, block for block (host chunks 1-2 and 5 among device ones).
@pytest.mark.parametrize("hblock,rblock,rformat,host_chunks,staged", [
    (128, 32, CPU, "2,3,4,5", True), (32, 32, FLASH_HND, "1,2,5", False)])
def test_host_chunks_are_read_through_staging(holders, reader, hblock, rblock, rformat, host_chunks, staged):
    start, _ = holders
    start("h", hblock, [0], "--host-chunks", host_chunks)
    r = reader(rblock, rformat)
    _load_checked(r, 0, staged)
    _, _, planner = r.worker.peers.connections[("h", 0)]
    host_planner, _ = r.worker.peers.host_planners[("h", 0)]
    assert isinstance(planner, ConvertingPlanner) and isinstance(host_planner, ConvertingPlanner)


def test_a_direct_device_route_and_a_converting_host_route_mix(holders, reader):
    start, _ = holders
    start("h", 32, [0], "--host-chunks", "0,3,4")
    r = reader(32)
    _load_checked(r, 0, False)  # block for block on both tiers, as before
    _, _, planner = r.worker.peers.connections[("h", 0)]
    host_planner, n_device = r.worker.peers.host_planners[("h", 0)]
    assert isinstance(planner, PeerPlanner) and isinstance(host_planner, PeerPlanner)
    # A host layout that needs converting (say, slots in another arrangement): staged, the
    # device blocks still straight into place.
    assert r.worker._staging is not None
    r.worker.peers.host_planners[("h", 0)] = (ConvertingPlanner(host_planner.remote, r.worker.layout,
                                                           r.worker._staging.region_index), n_device)
    _load_checked(r, 0, False)
