"""The handle of one TCP read, split into parts that run on parallel connections."""

from __future__ import annotations

import threading

from pdxfer.transport.base import ReadHandle, ReadState, TransferCancelled, TransferTimeout, TransportError
from pdxfer.transport.tcp.connection import Conn


class TcpReadHandle(ReadHandle):
    """A read split into parts (one per connection). Terminal only once every part has stopped,
    so after FAILED or CANCELLED no more bytes land in local memory."""

    def __init__(self, peer: str, nparts: int) -> None:
        self._peer = peer
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._pending = nparts
        self._state = ReadState.PENDING
        self._error: TransportError | None = None
        self._active: set[Conn] = set()
        if nparts == 0:
            self._state = ReadState.DONE
            self._done.set()

    # ---- called by workers
    def _begin(self, conn: Conn) -> bool:
        with self._lock:
            if self._error is not None:
                return False
            self._active.add(conn)
            return True

    def _wanted(self) -> bool:
        """False once the read was cancelled or failed: a part must not start sending then."""
        with self._lock:
            return self._error is None

    def _end(self, conn: Conn | None, err: TransportError | None) -> None:
        abort: list[Conn] = []
        with self._lock:
            if conn is not None:
                self._active.discard(conn)
            if err is not None and self._error is None:
                self._error = err
                abort = list(self._active)  # stop sibling parts: their bytes are useless now
            self._pending -= 1
            finished = self._pending == 0
            if finished:
                if self._error is None:
                    self._state = ReadState.DONE
                elif isinstance(self._error, TransferCancelled):
                    self._state = ReadState.CANCELLED
                else:
                    self._state = ReadState.FAILED
        for c in abort:
            c.abort()
        if finished:
            self._done.set()

    # ---- public
    def poll(self) -> ReadState:
        return self._state

    def wait(self, timeout: float) -> ReadState:
        if not self._done.wait(timeout):
            raise TransferTimeout(f"read from {self._peer} still pending after {timeout:.3f}s")
        if self._state is ReadState.DONE:
            return self._state
        assert self._error is not None
        raise self._error

    def cancel(self, timeout: float = 0.0) -> None:
        with self._lock:
            if self._done.is_set() or self._error is not None:
                return
            self._error = TransferCancelled(f"read from {self._peer} cancelled")
            active = list(self._active)
        for c in active:
            c.abort()
        # shutdown() wakes blocked receives at once; queued parts see the error and skip; a part
        # still connecting stops before it sends. poll() leaves PENDING only when all have stopped,
        # so callers that must not reuse the memory earlier poll instead of waiting here.
        self._done.wait(timeout)

    @property
    def error(self) -> TransportError | None:
        return self._error if self._state is not ReadState.PENDING else None

