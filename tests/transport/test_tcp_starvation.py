"""Unauthenticated connections must not starve a real reader of a TCP holder.

Real holder processes, real sockets: an attacker that opens far more connections than the holder
takes and never says a word, from one address or spread over many, must not keep a reader that
holds the holder's metadata from reading exact bytes at once.
"""

from __future__ import annotations

import socket
import time

import pytest

from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import ReadState
from pdxfer.transport.tcp.metadata import parse_metadata
from tests.transport.conftest import MiB, Reader, start_holder

pytestmark = pytest.mark.timeout(120)

FLOOD = 900


def _flood(host: str, port: int, n: int, sources: list[str]) -> list[socket.socket]:
    """``n`` connections that say nothing, round-robin over ``sources`` (loopback addresses)."""
    out = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((sources[i % len(sources)], 0))
        s.settimeout(5)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def _reads_right_away(holder) -> float:
    """Seconds a fresh reader took to connect and read exact bytes (fails if it cannot)."""
    reader = Reader("tcp", MiB)
    try:
        t0 = time.monotonic()
        peer = reader.t.connect(holder.meta, timeout=5)
        plan = scattered_plan(4096, 64, holder.sizes[0], reader.dst.nbytes, seed=5)
        assert reader.t.read(peer, plan).wait(5) is ReadState.DONE
        took = time.monotonic() - t0
        assert mismatches(plan, {0: reader.dst}, {0: holder.sizes[0]}) == []
        return took
    finally:
        reader.close()


@pytest.mark.parametrize("sources", [["127.0.0.1"], [f"127.0.1.{i}" for i in range(1, 31)]],
                         ids=["one-address", "thirty-addresses"])
def test_idle_connection_flood_does_not_lock_out_a_real_reader(procs, sources):
    """900 silent connections (more than the 256 the holder takes; the second case keeps each
    address under the per-address limit, so only the global cap acts) and a reader from the
    flooding address itself: it must read within the hello deadline, not be reset at the cap."""
    holder = start_holder("tcp", sizes=(4 * MiB,))
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    flood = _flood(info.host, info.port, FLOOD, sources)
    try:
        assert len(flood) >= 800, f"only {len(flood)} flood connections were made"
        time.sleep(0.2)  # let the holder's accept loop take what it will
        took = _reads_right_away(holder)
        assert took < 1.0, f"the reader needed {took:.2f}s behind the flood"
    finally:
        for s in flood:
            s.close()
