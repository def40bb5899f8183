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


@pytest.mark.parametrize("sources, opts", [
    (["127.0.0.1"], {}),
    # Each address under the per-address limit and a deadline the flood never waits out: only
    # giving up the oldest handshake at the cap can let the reader in.
    ([f"127.0.1.{i}" for i in range(1, 31)], {"hello_timeout": 60.0}),
], ids=["one-address", "thirty-addresses-long-deadline"])
def test_idle_connection_flood_does_not_lock_out_a_real_reader(procs, sources, opts):
    """900 silent connections (more than the 256 the holder takes) and a reader from a flooding
    address: it must read at once, not be reset at the cap."""
    holder = start_holder("tcp", sizes=(4 * MiB,), opts={"listen_host": "127.0.0.1", **opts})
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    t0 = time.monotonic()
    flood = _flood(info.host, info.port, FLOOD, sources)
    print(f"{len(flood)} flood connections in {time.monotonic() - t0:.2f}s")
    try:
        assert len(flood) >= 800, f"only {len(flood)} flood connections were made"
        time.sleep(0.2)  # let the holder's accept loop take what it will
        took = _reads_right_away(holder)
        assert took < 1.0, f"the reader needed {took:.2f}s behind the flood"
    finally:
        for s in flood:
            s.close()


def _open_after(socks: list[socket.socket], within: float) -> list[bool]:
    """For each socket: still open after ``within`` seconds (whatever it was sent is drained)."""
    time.sleep(within)
    out = []
    for s in socks:
        s.setblocking(False)
        while True:
            try:
                if s.recv(4096) == b"":
                    out.append(False)
                    break
            except BlockingIOError:
                out.append(True)
                break
            except OSError:  # reset
                out.append(False)
                break
    return out


def test_one_address_keeps_at_most_its_share_of_handshakes(procs):
    """max_handshakes_per_peer=8 and a cap far above the flood: of 20 silent connections from one
    address the 12 oldest are cut at once, the 8 newest wait out their deadline; another address
    is not affected."""
    holder = start_holder("tcp", sizes=(MiB,), opts={"max_handshakes_per_peer": 8, "hello_timeout": 30.0})
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    flood = _flood(info.host, info.port, 20, ["127.0.2.1"])
    other = _flood(info.host, info.port, 3, ["127.0.2.2"])
    try:
        assert len(flood) == 20 and len(other) == 3
        alive = _open_after(flood + other, 1.0)
        assert alive == [False] * 12 + [True] * 8 + [True] * 3, alive
    finally:
        for s in flood + other:
            s.close()
