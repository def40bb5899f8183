"""``pdxfer-probe serve``: the holder side of the probe.

Registers one region filled with the shared pattern with every transport that works here, and
answers a tiny JSON-lines control protocol (``hello``, ``meta``) so a reader on another host
needs only ``host:port``. It also runs the raw-socket baseline server: a reader sends a u64
byte count and gets that many bytes of the region (wrapping) with plain ``sendall``.

With ``memory="cuda:N"`` the region lives on that GPU (filled through a host copy); transports
that cannot register it are listed as unavailable with their reason, and there is no raw-socket
baseline (it streams host memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import threading

from pdxfer.common import netio
from pdxfer.probe.regions import ProbeBuffer
from pdxfer.transport import available_kinds, create_transport, transport_options
from pdxfer.transport.base import RegisteredRegion, Transport, TransportError

_U64 = struct.Struct("<Q")
SEED = 0


def _serve_raw(sock: socket.socket, view: memoryview) -> None:
    """Raw baseline: answer each u64 byte count with that many region bytes (plain sendall)."""
    size = len(view)
    with contextlib.suppress(OSError, struct.error):  # the reader hanging up ends the loop
        while True:
            (n,) = _U64.unpack(netio.recv_exact(sock, _U64.size, "byte count"))
            while n > 0:
                k = min(n, size)
                sock.sendall(view[:k])
                n -= k
    sock.close()


class ProbeServer:
    def __init__(self, host: str, port: int, region_size: int, kinds: list[str] | None = None,
                 advertise: str | None = None, memory: str = "cpu") -> None:
        self.region = ProbeBuffer(memory, region_size)
        self.region.fill_pattern(0, SEED)
        self.memory = memory
        host_buf = self.region.host
        self.view = memoryview(host_buf).cast("B") if host_buf is not None else None
        avail = available_kinds()
        self.unavailable = {k: why for k, why in avail.items() if why}
        wanted = kinds or [k for k, why in avail.items() if why is None]
        self.transports: dict[str, Transport] = {}
        for k in wanted:
            if avail.get(k):
                continue
            t = create_transport(k, **transport_options(k, listen_host=host, advertise_host=advertise))
            try:
                t.register([RegisteredRegion(0, self.region.ptr, self.region.nbytes, memory)])
            except TransportError as exc:
                t.close()
                if memory == "cpu":
                    raise
                self.unavailable[k] = f"cannot register {memory} memory: {exc}"
                continue
            self.transports[k] = t
        self.meta = {k: t.metadata().hex() for k, t in self.transports.items()}
        self.ctl = socket.create_server((host, port))
        self.raw = socket.create_server((host, 0))
        self.port = self.ctl.getsockname()[1]
        self.raw_port = self.raw.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, args=(self.ctl, self._control), daemon=True),
                         threading.Thread(target=self._accept, args=(self.raw, self._raw), daemon=True)]
        for t in self._threads:
            t.start()

    def _accept(self, lsock: socket.socket, handler) -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    def _raw(self, conn: socket.socket) -> None:
        if self.view is None:
            conn.close()  # GPU region: no host bytes to stream; readers refuse baselines first
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        _serve_raw(conn, self.view)

    def _control(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            for line in f:
                try:
                    req = json.loads(line)
                    op = req.get("op")
                    if op == "hello":
                        resp = {"kinds": sorted(self.transports), "unavailable": self.unavailable,
                                "region_size": self.region.nbytes, "seed": SEED, "raw_port": self.raw_port,
                                "memory": self.memory}
                    elif op == "cpu":
                        # Process CPU seconds (all threads): lets a reader put a load-independent
                        # cost per byte next to the wall-clock bandwidth.
                        ru = resource.getrusage(resource.RUSAGE_SELF)
                        resp = {"cpu": ru.ru_utime + ru.ru_stime}
                    elif op == "meta":
                        kind = req.get("kind")
                        if kind not in self.meta:
                            resp = {"error": f"transport {kind!r} not served here; have {sorted(self.meta)}"}
                        else:
                            resp = {"meta": self.meta[kind]}
                    else:
                        resp = {"error": f"unknown op {op!r}"}
                except (ValueError, AttributeError) as exc:
                    resp = {"error": f"bad request: {exc}"}
                f.write(json.dumps(resp).encode() + b"\n")
                f.flush()

    def close(self) -> None:
        for s in (self.ctl, self.raw):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self.transports.values():
            t.close()


def run_server(host: str, port: int, region_size: int, kinds: list[str] | None, advertise: str | None,
               memory: str = "cpu") -> int:
    server = ProbeServer(host, port, region_size, kinds, advertise, memory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"PROBE-SERVE {host}:{server.port} kinds={','.join(sorted(server.transports))} "
          f"region={region_size} memory={memory} pid={os.getpid()}", flush=True)
    while not stop.wait(1.0):
        pass
    server.close()
    return 0


def control_request(addr: tuple[str, int], req: dict, timeout: float = 10.0) -> dict:
    """One JSON request to a probe server's control port."""
    with socket.create_connection(addr, timeout=timeout) as s, s.makefile("rwb") as f:
        f.write(json.dumps(req).encode() + b"\n")
        f.flush()
        line = f.readline()
    if not line:
        raise ConnectionError(f"probe server {addr[0]}:{addr[1]} closed the control connection")
    resp = json.loads(line)
    if "error" in resp:
        raise RuntimeError(f"probe server {addr[0]}:{addr[1]}: {resp['error']}")
    return resp
