"""Issue 9, hole 9 (TCP holder): a peer must not be able to stop a holder from serving.

Real holder processes and raw sockets: running out of file descriptors, connections that never
say hello or stall inside a frame, a header that announces a huge run list, and more connections
than the holder takes must each cost at most that connection, never the holder.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time

import pytest


from pdxfer.transport.tcp import handshake, wire
from pdxfer.transport.tcp.metadata import parse_metadata
from pdxfer.probe.pattern import mismatches, scattered_plan
from pdxfer.transport.base import ReadState
from tests.transport.conftest import Reader, start_holder



def _connect(info) -> socket.socket:
    s = socket.create_connection((info.host, info.port), timeout=5)
    s.settimeout(5)
    return s


def _hello(s: socket.socket, info) -> None:
    handshake.prove(s, info.instance, info.secret, time.monotonic() + 5, "holder")
    s.settimeout(5)


def still_serves(holder, timeout: float = 10.0) -> None:
    """A new reader's fresh connection moves exact bytes: the holder still serves."""
    reader = Reader("tcp")
    try:
        peer = reader.t.connect(holder.meta, timeout=timeout)
        plan = scattered_plan(4096, 64, holder.sizes[0], reader.dst.nbytes, seed=3)
        assert reader.t.read(peer, plan).wait(timeout) is ReadState.DONE
        assert mismatches(plan, {0: reader.dst}, {0: holder.sizes[0]}) == []
    finally:
        reader.close()


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


FD_LIMIT = 48  # the holder's RLIMIT_NOFILE: a few dozen readers exhaust it
# What the holder logs when accept() fails for want of descriptors (server.py's accept loop).
EMFILE_WARNING = f"accept failed ([Errno {errno.EMFILE}]"


class _Stderr:
    """A child's stderr as it comes, read without blocking: what the holder logged so far."""

    def __init__(self, proc) -> None:
        self.fd = proc.stderr.fileno()
        self.text = ""

    def take(self) -> None:
        """Read what is there now (call when select() says the fd is readable)."""
        self.text += os.read(self.fd, 65536).decode(errors="replace")


def _challenged_or_out_of_fds(s: socket.socket, err: _Stderr, timeout: float) -> bool:
    """True once the holder sent ``s`` its challenge (it accepted ``s``), False once it logged an
    accept failing with EMFILE; whichever comes first, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"neither a challenge nor EMFILE within {timeout}s; holder stderr: {err.text[-2000:]}"
        ready, _, _ = select.select([s, err.fd], [], [], left)
        if err.fd in ready:
            err.take()
        if EMFILE_WARNING in err.text:
            return False
        if s in ready:
            return True


def test_holder_keeps_serving_after_running_out_of_file_descriptors(procs):
    holder = start_holder("tcp", prefix_cmd=["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}"])
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    err = _Stderr(holder.proc)
    kept: list[socket.socket] = []
    try:
        # Authenticated readers keep their descriptors (no hello deadline cuts them), so each one
        # takes one more of the holder's until its accept() fails with EMFILE. The connection it
        # could not take stays in the listen backlog.
        for _ in range(FD_LIMIT):
            s = _connect(info)
            kept.append(s)
            if not _challenged_or_out_of_fds(s, err, 10):
                break
            _hello(s, info)
        else:
            raise AssertionError(f"{FD_LIMIT} readers never made the holder's accept() fail with EMFILE")
        stuck = kept.pop()
        assert holder.proc.poll() is None, "the holder died of EMFILE"
    finally:
        for s in kept:
            s.close()
    # Descriptors came back: the connection accept() failed on is taken and admitted ...
    _hello(stuck, info)
    stuck.close()
    # ... and the holder goes on serving new readers.
    still_serves(holder)


def test_silent_and_stalled_connections_are_cut(procs):
    holder = start_holder("tcp", opts={"hello_timeout": 0.5, "frame_timeout": 0.5})
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    silent = _connect(info)
    wire.recv_exact(silent, handshake.CHALLENGE_SIZE, "challenge")  # all it ever gets
    assert _closed_by_peer(silent, 5), "a connection that never says hello was kept"
    stalled = _connect(info)
    _hello(stalled, info)
    stalled.sendall(b"\x00" * 3)  # the start of a request header, then nothing
    assert _closed_by_peer(stalled, 5), "a connection stalled inside a frame was kept"


def test_huge_run_list_header_is_refused_before_buffering(procs):
    holder = start_holder("tcp")
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    s = _connect(info)
    _hello(s, info)
    # Just over the per-request cap: 32 bytes must not make the holder wait for (and buffer) MiBs.
    head = wire._seal(wire._REQ.pack(wire.MAGIC_REQ, wire.WIRE_VERSION, 0, 1, wire.MAX_RUNS_PER_REQUEST + 1, 0))
    s.sendall(head)
    assert _closed_by_peer(s, 5), "a header announcing more runs than the cap was not refused at once"


def test_connections_beyond_a_cap_of_readers_are_refused_and_the_rest_served(procs):
    """Only authenticated readers fill every slot: then a newcomer is refused, none of them cut."""
    holder = start_holder("tcp", opts={"max_connections": 4})
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    kept = [_connect(info) for _ in range(4)]
    for s in kept:
        _hello(s, info)
    extra = _connect(info)
    assert _closed_by_peer(extra, 5), "a fifth connection was taken beyond max_connections=4"
    for s in kept:
        s.close()
    time.sleep(0.5)
    still_serves(holder)


def test_a_handshake_trickled_byte_by_byte_is_cut_at_the_hello_deadline(procs):
    """The hello deadline bounds the whole handshake from accept, not each receive: a peer that
    sends one byte of a well-formed proof every 0.2 s is cut after about 1 s (the default)."""
    holder = start_holder("tcp")
    procs.append(holder.proc)
    info = parse_metadata(holder.meta)
    s = _connect(info)
    t0 = time.monotonic()
    wire.recv_exact(s, handshake.CHALLENGE_SIZE, "challenge")
    proof = handshake.pack_proof(bytes(32), bytes(32))
    cut = None
    for b in proof[:-1]:  # never the last byte: the proof stays unfinished
        try:
            s.sendall(bytes([b]))
        except OSError:
            cut = time.monotonic() - t0
            break
        if _closed_by_peer(s, 0.2):
            cut = time.monotonic() - t0
            break
    assert cut is not None, "a trickled handshake was kept past its deadline"
    assert cut < 2.5, f"a trickled handshake was kept {cut:.1f}s (hello deadline 1 s)"


def test_a_reader_holding_its_verdict_is_never_cut_as_a_handshake(monkeypatch):
    """The holder counts a reader as authenticated before its OK verdict leaves: a serving thread
    descheduled right after sending it (simulated: admit stalls once it returned) must not leave
    the reader in the handshakes that a newcomer at the cap may cut. (Failed on the old code,
    which promoted after the verdict: the fifth connection was taken and a reader cut.)"""
    from pdxfer.transport.tcp import server as tcp_server

    real_admit = handshake.admit

    def stalled_admit(*args, **kwargs):
        real_admit(*args, **kwargs)
        time.sleep(0.5)

    monkeypatch.setattr(tcp_server.handshake, "admit", stalled_admit)
    instance, secret = os.urandom(16), os.urandom(32)
    srv = tcp_server.TcpServer(tcp_server.RegionTable(), instance, lambda: secret, "127.0.0.1", 0, 1 << 16,
                               max_connections=2, hello_timeout=5.0)
    try:
        kept = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            handshake.prove(s, instance, secret, time.monotonic() + 5, "holder")
            kept.append(s)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        assert _closed_by_peer(extra, 2), "a third connection was taken beyond max_connections=2"
        assert srv.evicted_handshakes == 0
        for s in kept:  # both readers still connected: nothing arrives, nothing closes
            s.setblocking(False)
            try:
                assert s.recv(1) != b"", "an authenticated reader was cut"
            except BlockingIOError:
                pass
    finally:
        srv.close()


def test_what_unauthenticated_peers_cost_is_counted_by_kind():
    """Issue 42, hole 7: the holder's refused and evicted handshakes were not exported, failed
    proofs and timed-out handshakes not even counted. A real TcpServer and raw sockets."""
    from pdxfer.transport.tcp import server as tcp_server

    def cut_within(s: socket.socket, within: float) -> bool:
        """The holder closed ``s`` within ``within`` s (its challenge read and dropped)."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                if s.recv(4096) == b"":
                    return True
            except socket.timeout:
                return False
            except OSError:
                return True
        return False

    instance, secret = os.urandom(16), os.urandom(32)
    srv = tcp_server.TcpServer(tcp_server.RegionTable(), instance, lambda: secret, "127.0.0.1", 0, 1 << 16,
                               max_connections=2, max_handshakes_per_peer=1, hello_timeout=0.5)
    zero = {"refused_connections": 0, "evicted_handshakes": 0, "auth_failures": 0, "handshake_timeouts": 0}
    try:
        assert srv.guard_counts() == zero
        guess = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        with pytest.raises(handshake.AuthRefused):
            handshake.prove(guess, instance, os.urandom(32), time.monotonic() + 5, "holder")
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        assert cut_within(silent, 3), "a silent connection outlived hello_timeout"
        first = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        time.sleep(0.1)
        second = socket.create_connection(("127.0.0.1", srv.port), timeout=5)  # same peer: cuts the first
        assert cut_within(first, 0.4)  # before its own hello_timeout: evicted
        readers = []
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            handshake.prove(s, instance, secret, time.monotonic() + 5, "holder")
            readers.append(s)
        extra = socket.create_connection(("127.0.0.1", srv.port), timeout=5)  # every slot a reader's
        assert cut_within(extra, 2)
        deadline = time.monotonic() + 5
        while srv.guard_counts()["handshake_timeouts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = srv.guard_counts()
        assert counts["auth_failures"] == 1 and counts["refused_connections"] == 1, counts
        assert counts["evicted_handshakes"] >= 1 and counts["handshake_timeouts"] >= 1, counts
        for s in [guess, silent, first, second, extra, *readers]:
            s.close()
    finally:
        srv.close()
