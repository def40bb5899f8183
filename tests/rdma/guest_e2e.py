"""Inside the guest: pdxfer-master + a holder process (NIXL on rxe1) + this reader (NIXL on rxe0)
moving published chunks end to end over rc_verbs, found by content through the master."""

from __future__ import annotations

import subprocess
import sys

import torch

from pdxfer.kv.keys import chunk_hashes
from pdxfer.kv.layout import KVLayout
from pdxfer.master import MasterClient, start_local_master
from pdxfer.planning.peer_plan import build_plan
from pdxfer.transport import create_transport
from pdxfer.transport.base import ReadState, RegisteredRegion
from tests.transport.conftest import REPO, child_env, read_line, stop

from . import e2e_peer as peer
from .conftest import HOLDER_PREFIX, START_S, guest_bound


def test_master_holder_reader_move_chunks_over_rxe():
    master = start_local_master(timeout_s=START_S)
    holder = None
    t = None
    try:
        holder = subprocess.Popen(HOLDER_PREFIX + [sys.executable, "-m", "tests.rdma.e2e_peer", "--master",
                                                   master.address, "--node-id", "holder-0"],
                                  cwd=REPO, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # This holder imports torch too: two process starts' worth.
        assert read_line(holder, "READY ", 2 * START_S).split()[1] == "3", "the master did not accept 3 chunks"
        whole, caches = peer.kv_cache(None)
        local = peer.layout_of(caches)
        t = create_transport("nixl")
        t.register([RegisteredRegion(r.index, r.ptr, r.nbytes) for r in local.regions])
        with MasterClient(master.address, timeout_s=10.0) as client:
            keys = chunk_hashes(peer.TOKENS, peer.CHUNK_TOKENS)
            res = client.lookup_and_lock(keys + [b"\x01" * 32], reader="reader-0", lock_ttl_s=60)
            assert res.hit_chunks == 3 and res.lock_id, res
            node = res.nodes[res.locations[0].node_id]
            remote = KVLayout.from_wire(node.layout)
            conn = t.connect(node.transport_metadata, timeout=guest_bound(30))
            remote_blocks = [b for loc in res.locations for b in loc.block_ids]
            local_blocks = [b for i in range(3) for b in (50 - 2 * i, 51 - 2 * i)]  # reordered on purpose
            plan = build_plan(remote, remote_blocks, local, local_blocks)
            assert t.read(conn, plan).wait(guest_bound(60)) is ReadState.DONE
            assert client.release(res.lock_id), "the lock expired before the read finished"
        expected, _ = peer.kv_cache(7)
        for rb, lb in zip(remote_blocks, local_blocks):
            assert torch.equal(whole[:, lb].view(torch.int16), expected[:, rb].view(torch.int16)), (rb, lb)
        untouched = sorted(set(range(peer.NUM_BLOCKS)) - set(local_blocks))
        assert not whole[:, untouched].view(torch.int16).any(), "bytes landed outside the planned blocks"
    finally:
        if t is not None:
            t.close()
        if holder is not None:
            stop(holder)
        master.stop()
