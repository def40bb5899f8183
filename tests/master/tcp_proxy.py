"""A small real TCP proxy for fault injection in tests: forwards after a delay, or stops
forwarding (a black hole: bytes are read and dropped, connections stay open, like a cut link)."""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s  # applied to bytes from the client towards the upstream
        self.cut = threading.Event()  # set: forward nothing more, in either direction
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self._srv.settimeout(0.2)
        self.port = self._srv.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=2.0)
            except OSError:
                client.close()
                continue
            for s in (client, up):
                s.settimeout(0.2)
                self._socks.append(s)
            self._spawn(self._pump, client, up, self.delay_s)
            self._spawn(self._pump, up, client, 0.0)

    def _pump(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if delay_s:
                time.sleep(delay_s)
            if self.cut.is_set():
                continue  # black hole
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(2.0)
