"""TCP transport reconnects leave nothing open behind (issue 19: a soak saw the fds and threads of
its prefill and decode step up and down by 2-3, and drift a few over 30 minutes).

A reader's connections to a holder end two ways in a long run: the holder cuts them after its
idle timeout (the reader reconnects at its next read), or the reader drops the holder after a
failed load and connects again. After K of either, reader and holder hold the same fds of every
kind and the same threads as after one.
"""

from __future__ import annotations

import os
import time

from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import ReadState
from tests.fd_census import fd_kinds, thread_names
from tests.transport.conftest import Reader, start_holder, stop, transport_options

ROUNDS = 6


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _read(reader: Reader, peer: str, holder) -> None:
    plan = scattered_plan(4096, 16, holder.sizes[0], reader.dst.nbytes, seed=5)
    assert reader.t.read(peer, plan).wait(30) is ReadState.DONE
    assert mismatches(plan, {0: reader.dst}, {0: holder.sizes[0]}) == []


def _settled(holder, expect):
    """(fds by kind of both sides, reader threads, holder threads) once equal to ``expect``, or
    (``expect`` None) once the same three polls in a row; bounded. Threads of dropped connections
    end, and closes reach the other side, a moment after the read."""
    deadline = time.monotonic() + 10
    seen = []
    while True:
        now = (fd_kinds(reader=os.getpid(), holder=holder.proc.pid), thread_names(), _threads(holder.proc.pid))
        seen = [*seen[-2:], now]
        if (now == expect if expect is not None else len(seen) == 3 and seen.count(now) == 3):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _local_ports(reader: Reader, peer: str) -> set[int]:
    """Ports of the reader's sockets to ``peer``: new ones after a reconnect."""
    return {c.sock.getsockname()[1] for c in reader.t._peers[peer].conns if c.sock is not None}


def test_connections_the_holder_cut_for_idleness_cost_nothing_once_reconnected():
    opts = {**transport_options("tcp"), "idle_timeout": 0.3}
    holder = start_holder("tcp", opts=opts)
    reader = Reader("tcp")
    try:
        peer = reader.t.connect(holder.meta, timeout=10)
        first = None
        for n in range(ROUNDS):
            _read(reader, peer, holder)
            before = _local_ports(reader, peer)
            # Idle past the holder's timeout: it cuts both connections; the next read reconnects.
            time.sleep(0.6)
            _read(reader, peer, holder)
            # The read went over one of the two and reconnected it; the other stays as the holder
            # left it (closed at its end) until a read needs it.
            assert _local_ports(reader, peer) != before, "the holder did not cut the idle connections"
            now = _settled(holder, first)
            if first is None:
                first = now
                assert first[0]["reader"]["socket:tcp->holder"] == 2, first  # the transport's two
            assert now == first, f"after {n + 1} idle cuts: {now}; after the first: {first}"
    finally:
        reader.close()
        stop(holder.proc)


def test_a_reader_that_drops_and_reconnects_a_holder_holds_what_it_held():
    holder = start_holder("tcp")
    reader = Reader("tcp")
    try:
        first = None
        for n in range(ROUNDS):
            peer = reader.t.connect(holder.meta, timeout=10)
            _read(reader, peer, holder)
            now = _settled(holder, first)
            if first is None:
                first = now
            assert now == first, f"after {n + 1} reconnects: {now}; after the first: {first}"
            reader.t.disconnect(peer)  # as a worker does after a failed load
    finally:
        reader.close()
        stop(holder.proc)
