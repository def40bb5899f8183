"""A small threaded TCP proxy put in the master link: forward, delay, cut.

Each accepted connection gets its own upstream connection and two pump threads. ``delay`` holds
every chunk for that long before forwarding it (order within a connection is kept, so a request
sent on a connection that the client already gave up on still arrives late, as on a slow
network; a newer connection made after the delay ended overtakes it). ``cut`` closes every live
connection and refuses new ones until it is lifted.
"""

from __future__ import annotations

import socket
import threading
import time


class Proxy:
    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self.delay_s = 0.0
        self.cut = False
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((host, port))
        self._srv.listen(128)
        self._srv.settimeout(0.2)  # lets the accept loop notice close()
        self.address = self._srv.getsockname()
        self._thread = threading.Thread(target=self._accept_loop, name="chaos-proxy", daemon=True)
        self._thread.start()

    @property
    def hostport(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def set_cut(self, cut: bool) -> None:
        with self._lock:
            self.cut = cut
            socks = list(self._socks) if cut else []
        for s in socks:
            self._kill(s)

    def _kill(self, s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass
        with self._lock:
            self._socks.discard(s)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut:
                self._kill(client)
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=1.0)
            except OSError:
                self._kill(client)  # upstream down: the client sees the connection close
                continue
            for s in (client, up):
                s.settimeout(0.2)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks |= {client, up}
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), name="chaos-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed:
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    if self.cut:
                        break
                    continue
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)  # pass the half-close on, after what came before
                    except OSError:
                        pass
                    return
                due = time.monotonic() + self.delay_s
                while time.monotonic() < due and not self.cut and not self._closed:
                    time.sleep(min(0.01, max(due - time.monotonic(), 0)))
                if self.cut:
                    break
                dst.settimeout(5.0)
                dst.sendall(data)
        except OSError:
            pass
        self._kill(src)
        self._kill(dst)

    def close(self) -> None:
        self._closed = True
        try:
            self._srv.close()
        except OSError:
            pass
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            self._kill(s)
        self._thread.join(timeout=2.0)
