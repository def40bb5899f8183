"""TCP-specific behaviour: the holder's own range checks against a hostile raw client, frame
corruption and truncation detection, instance checks after a restart, an idle holder's CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import zlib
from typing import Callable

import numpy as np
import pytest

from pdxfer.transport.plan import TransferPlan, TransferRun
from pdxfer.probe.pattern import pattern
from pdxfer.transport.tcp import handshake, wire
from pdxfer.transport.base import (
    MetadataError,
    PeerDied,
    ReadState,
    RegionUnknown,
    RegisteredRegion,
    TransportError,
)
from pdxfer.transport.tcp import TcpTransport, parse_metadata
from pdxfer.transport.tcp.connection import is_stale

from .conftest import MiB, freeze, start_holder, stop

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tcp_holder():
    h = start_holder("tcp", sizes=(MiB, 4096))
    yield h
    stop(h.proc)


def raw_session(info):
    s = socket.create_connection((info.host, info.port), timeout=5)
    handshake.prove(s, info.instance, info.secret, time.monotonic() + 5, "holder")
    s.settimeout(5)
    return s


def raw_request(s, runs, req_id=1, flags=0):
    s.sendall(wire.pack_request(req_id, runs, flags))
    status, rid, length, rflags = wire.unpack_response(wire.recv_exact(s, wire.RESP_SIZE, "resp"))
    assert rid == req_id
    body = wire.recv_exact(s, length, "body")
    trailer = wire.TRAILER.unpack(wire.recv_exact(s, wire.TRAILER.size, "trailer")) if status == wire.OK else None
    return status, body, trailer


def test_holder_rejects_out_of_range_runs_from_a_hostile_client(tcp_holder):
    """A reader that skips its own checks still cannot read past what the holder registered."""
    info = parse_metadata(tcp_holder.meta)
    s = raw_session(info)
    try:
        status, text, _ = raw_request(s, [(0, 0, 16), (0, MiB - 8, 9)])
        assert status == wire.ERR_OUT_OF_RANGE and b"run 1" in text and b"region 0" in text
        status, text, _ = raw_request(s, [(2, 0, 1)], req_id=2)
        assert status == wire.ERR_REGION_UNKNOWN and b"region 2" in text
        status, text, _ = raw_request(s, [(1, 4095, 2)], req_id=3)
        assert status == wire.ERR_OUT_OF_RANGE
        # Same connection still serves, and the payload CRC is right when asked for.
        status, body, trailer = raw_request(s, [(1, 4000, 96), (0, 10, 6)], req_id=4, flags=wire.FLAG_PAYLOAD_CRC)
        assert status == wire.OK
        want = bytes(pattern(1, 4096)[4000:]) + bytes(pattern(0, MiB)[10:16])
        assert body == want
        assert trailer == (wire.MAGIC_END, zlib.crc32(want), 102)
    finally:
        s.close()


def test_holder_checks_every_run_of_a_large_request(tcp_holder):
    """Large run lists take the vectorized path on the holder: same checks, same messages."""
    info = parse_metadata(tcp_holder.meta)
    s = raw_session(info)
    try:
        runs = [(0, i * 1000, 1000) for i in range(100)]
        status, body, _ = raw_request(s, runs)
        assert status == wire.OK and body == bytes(pattern(0, MiB)[:100_000])
        runs[77] = (0, MiB - 10, 11)
        status, text, _ = raw_request(s, runs, req_id=2)
        assert status == wire.ERR_OUT_OF_RANGE and text.startswith(b"run 77:")
        runs[77] = (0, (1 << 64) - 5, 10)  # offset + length wraps 64 bits: must not pass as small
        status, text, _ = raw_request(s, runs, req_id=3)
        assert status == wire.ERR_OUT_OF_RANGE and text.startswith(b"run 77:")
        runs[77] = (5, 0, 10)
        status, text, _ = raw_request(s, runs, req_id=4)
        assert status == wire.ERR_REGION_UNKNOWN and text.startswith(b"run 77:")
    finally:
        s.close()


def test_holder_drops_a_corrupt_request_and_keeps_serving(tcp_holder):
    info = parse_metadata(tcp_holder.meta)
    s = raw_session(info)
    frame = bytearray(wire.pack_request(1, [(0, 0, 16)]))
    frame[-3] ^= 0xFF  # flip a bit in the run list: body CRC must catch it
    s.sendall(frame)
    s.settimeout(5)
    assert s.recv(1) == b"", "holder must close a connection whose request fails its CRC"
    s.close()
    s = raw_session(info)
    assert raw_request(s, [(0, 0, 16)])[0] == wire.OK
    s.close()


def test_wrong_instance_is_refused(tcp_holder):
    info = parse_metadata(tcp_holder.meta)
    s = socket.create_connection((info.host, info.port), timeout=5)
    with pytest.raises(handshake.AuthRefused, match="stale") as exc:
        handshake.prove(s, b"x" * 16, info.secret, time.monotonic() + 5, "holder")
    assert info.instance.hex()[:8] not in str(exc.value)
    s.close()


class FakeHolder:
    """A real socket server speaking the wire protocol, but sending what ``respond`` builds."""

    def __init__(self, respond):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.instance = bytes(range(16))
        self.secret = bytes(range(32))
        self.respond = respond
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def meta(self, nbytes: int) -> bytes:
        return json.dumps({"kind": "tcp", "v": 2, "wire": wire.WIRE_VERSION, "host": "127.0.0.1",
                           "port": self.port, "instance": self.instance.hex(), "secret": self.secret.hex(),
                           "regions": [{"index": 0, "nbytes": nbytes, "device": "cpu"}]}).encode()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c):
        if True:
            try:
                handshake.admit(c, self.instance, self.secret, time.monotonic() + 5)
                c.settimeout(5)
                head = wire.recv_exact(c, wire.REQ_SIZE, "req")
                _f, req_id, nruns, _crc = wire.unpack_request_head(head)
                runs = list(wire.RUN.iter_unpack(wire.recv_exact(c, nruns * wire.RUN.size, "runs")))
                c.sendall(self.respond(req_id, sum(n for _r, _o, n in runs)))
            except (OSError, TransportError):
                pass
            finally:
                c.close()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _read_from_fake(respond, payload_crc=False):
    fake = FakeHolder(respond)
    dst = np.zeros(8192, dtype=np.uint8)
    t = TcpTransport(payload_crc=payload_crc)
    try:
        t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
        peer = t.connect(fake.meta(8192), timeout=5)
        t0 = time.monotonic()
        with pytest.raises(PeerDied) as info:
            t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 4096),), 1)).wait(10)
        assert time.monotonic() - t0 < 5
        return info.value
    finally:
        t.close()
        fake.close()


def test_truncated_payload_is_detected():
    err = _read_from_fake(lambda rid, n: wire.pack_response(wire.OK, rid, n) + b"\x01" * (n // 2))
    assert "closed" in str(err)


def test_corrupt_response_header_is_detected():
    def respond(rid, n):
        head = bytearray(wire.pack_response(wire.OK, rid, n))
        head[12] ^= 0x40
        return bytes(head) + b"\x00" * n + wire.pack_trailer(0, n)
    assert isinstance(_read_from_fake(respond), wire.CorruptFrame)


def test_length_mismatch_and_bad_trailer_are_detected():
    short = lambda rid, n: wire.pack_response(wire.OK, rid, n - 1) + b"\x00" * (n - 1) + wire.pack_trailer(0, n - 1)
    assert isinstance(_read_from_fake(short), wire.CorruptFrame)
    badtrail = lambda rid, n: wire.pack_response(wire.OK, rid, n) + b"\x00" * n + wire.pack_trailer(0, n + 1)
    assert isinstance(_read_from_fake(badtrail), wire.CorruptFrame)


def test_payload_corruption_is_detected_when_crc_is_on():
    def respond(rid, n):
        payload = b"\x07" * n
        return (wire.pack_response(wire.OK, rid, n, wire.FLAG_PAYLOAD_CRC) + payload[:-1] + b"\x08"
                + wire.pack_trailer(zlib.crc32(payload), n))
    err = _read_from_fake(respond, payload_crc=True)
    assert isinstance(err, wire.CorruptFrame) and "CRC" in str(err)


def test_metadata_of_another_kind_or_version_is_refused():
    with pytest.raises(MetadataError, match="kind"):
        parse_metadata(b'{"kind": "nixl", "v": 1}')
    with pytest.raises(MetadataError, match="version"):
        parse_metadata(b'{"kind": "tcp", "v": 99}')
    with pytest.raises(MetadataError, match="version 1"):
        parse_metadata(b'{"kind": "tcp", "v": 1, "host": "h"}')
    with pytest.raises(MetadataError, match="wire version 1"):
        parse_metadata(b'{"kind": "tcp", "v": 2, "wire": 1, "host": "h"}')
    with pytest.raises(MetadataError):
        parse_metadata(b'{"kind": "tcp", "v": 2, "wire": 2, "host": "h"}')


def test_holder_restarted_on_the_same_port_is_not_mistaken_for_the_old_one(reader_factory):
    first = start_holder("tcp", sizes=(MiB,))
    try:
        port = parse_metadata(first.meta).port
        reader = reader_factory("tcp", MiB)
        peer = reader.t.connect(first.meta, timeout=5)
        plan = TransferPlan((TransferRun(0, 0, 0, 0, 4096),), 1)
        reader.t.read(peer, plan).wait(5)
    finally:
        stop(first.proc)
    second = start_holder("tcp", sizes=(MiB,), opts={"listen_host": "127.0.0.1", "listen_port": port})
    try:
        assert parse_metadata(second.meta).port == port
        with pytest.raises(PeerDied, match="restarted"):
            reader.t.read(peer, plan).wait(5)
        peer2 = reader.t.connect(second.meta, timeout=5)
        assert peer2 != peer
        assert reader.t.read(peer2, plan).wait(5).value == "done"
    finally:
        stop(second.proc)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_holder_uses_no_cpu(tcp_holder, reader_factory):
    reader = reader_factory("tcp", MiB)
    reader.t.connect(tcp_holder.meta, timeout=5)  # connected readers, but nothing requested
    time.sleep(0.3)
    before = _cpu_seconds(tcp_holder.proc.pid)
    time.sleep(2.0)
    used = _cpu_seconds(tcp_holder.proc.pid) - before
    assert used < 0.1, f"idle holder burned {used:.2f}s CPU in 2s"


def test_a_device_region_without_its_tensor_is_refused_with_a_clear_error():
    t = TcpTransport()
    try:
        with pytest.raises(TransportError, match="host memory only"):
            t.register([RegisteredRegion(0, 0x1000, 64, "cuda:0")])
    finally:
        t.close()


def test_deregistered_memory_is_no_longer_served(reader_factory):
    src = np.arange(MiB, dtype=np.uint8)
    holder = TcpTransport()
    try:
        holder.register([RegisteredRegion(0, src.ctypes.data, src.nbytes)])
        reader = reader_factory("tcp", MiB)
        peer = reader.t.connect(holder.metadata(), timeout=5)
        plan = TransferPlan((TransferRun(0, 0, 0, 0, 4096),), 1)
        reader.t.read(peer, plan).wait(5)
        assert bytes(reader.dst[:4096]) == bytes(src[:4096])
        holder.deregister()
        with pytest.raises(RegionUnknown, match="not registered"):
            reader.t.read(peer, plan).wait(5)
    finally:
        holder.close()


def test_payload_crc_mode_reads_exact_bytes_from_a_real_holder(tcp_holder):
    dst = np.zeros(MiB, dtype=np.uint8)
    t = TcpTransport(payload_crc=True)
    try:
        t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
        peer = t.connect(tcp_holder.meta, timeout=5)
        runs = tuple(TransferRun(0, (i * 7919) % (MiB - 4096), 0, i * 4096, 4096) for i in range(100))
        t.read(peer, TransferPlan(runs, len(runs))).wait(10)
        want = pattern(0, MiB)
        for r in runs:
            assert np.array_equal(dst[r.local_offset:r.local_offset + r.nbytes],
                                  want[r.remote_offset:r.remote_offset + r.nbytes])
    finally:
        t.close()


def test_reader_deregister_cancels_in_flight_reads(reader_factory):
    holder = start_holder("tcp", sizes=(64 * MiB,))
    try:
        reader = reader_factory("tcp", 64 * MiB)
        peer = reader.t.connect(holder.meta, timeout=5)
        freeze(holder.proc.pid)
        h = reader.t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 64 * MiB),), 1))
        reader.t.deregister()
        assert h.poll() is ReadState.CANCELLED  # settled before deregister returned
        with pytest.raises(RegionUnknown):
            reader.t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 16),), 1))
    finally:
        os.kill(holder.proc.pid, signal.SIGCONT)
        stop(holder.proc)


def test_no_byte_lands_after_a_cancel_that_caught_a_part_reconnecting(procs):
    """Issue 9, hole 5: a read cancelled while its part is (re)connecting must not write later.

    The holder cuts idle connections after 0.3 s, so the read has to reconnect; the holder is
    frozen meanwhile, so the part waits inside the hello. The cancel comes then; the holder thaws
    and answers. No byte may land in the reader's memory after the cancel, and only then may the
    handle say it has stopped."""
    holder = start_holder("tcp", opts={"idle_timeout": 0.3})
    procs.append(holder.proc)
    port = parse_metadata(holder.meta).port
    dst = np.zeros(1 * MiB, dtype=np.uint8)
    t = TcpTransport(connections=1, io_timeout=10.0)
    try:
        t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
        peer = t.connect(holder.meta, timeout=10)
        conn = t._peers[peer].conns[0]
        old = conn.sock
        _wait(lambda: is_stale(old), 10, "the holder to cut the idle connection")
        freeze(holder.proc.pid)
        assert _accept_backlog(port) == 0
        h = t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 1 * MiB),), 1))
        # The part's new connection waits in the frozen holder's accept queue: it is inside its
        # reconnect, waiting for the hello, when the cancel comes.
        _wait(lambda: _accept_backlog(port) == 1, 10, "the part to reconnect to the frozen holder")
        assert h.poll() is ReadState.PENDING and conn.sock is None
        h.cancel(timeout=0.5)
        os.kill(holder.proc.pid, signal.SIGCONT)
        _wait(lambda: h.poll() is not ReadState.PENDING, 10, "the cancelled read to settle")
        assert h.poll() is ReadState.CANCELLED
        # The connection's queue runs one task at a time: once this one ran, the part is over,
        # whatever the handle said, so a late receive would have landed by now.
        conn.queue.submit(lambda: None).result(timeout=10)
        assert not dst.any(), "bytes landed after the read was cancelled"
        # The transport goes on: the next read to the holder is exact.
        assert t.read(peer, TransferPlan((TransferRun(0, 0, 0, 0, 4096),), 1)).wait(10) is ReadState.DONE
        assert np.array_equal(dst[:4096], pattern(0, 4096))
    finally:
        t.close()


def _wait(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.01)


def _accept_backlog(port: int) -> int:
    """Connections queued on the listening socket of 127.0.0.1:``port`` that nobody accepted
    yet (the kernel's accept queue: /proc/net/tcp's rx_queue of a LISTEN socket)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"no listening socket on port {port}")


def test_many_concurrent_reads_on_few_connections_all_finish(procs):
    """Issue 9, hole 10: a read that sent its request from the caller's thread handed its
    connection lock to a queued task; pool workers blocked on that lock could all be taken,
    and every read on the transport then hung until its timeout."""
    holder = start_holder("tcp")
    procs.append(holder.proc)
    dst = np.zeros(16 * MiB, dtype=np.uint8)
    t = TcpTransport(connections=2, io_timeout=10.0)
    from pdxfer.transport.base import RegisteredRegion

    t.register([RegisteredRegion(0, dst.ctypes.data, dst.nbytes)])
    errors: list[str] = []
    done = [0]
    try:
        peer = t.connect(holder.meta, timeout=10)

        def reads(i: int) -> None:
            for k in range(40):
                plan = TransferPlan((TransferRun(0, (i * 7 + k) % 64 * 65536, 0, i * MiB, 65536),), 1)
                try:
                    t.read(peer, plan).wait(10)
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001 - any failure is the finding
                    errors.append(repr(exc))
                    return

        threads = [threading.Thread(target=reads, args=(i,)) for i in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, f"{len(errors)} threads failed after {done[0]} reads: {errors[0]}"
        assert done[0] == 16 * 40
    finally:
        t.close()
