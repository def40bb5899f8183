"""The handle of one NIXL READ: polling it is what progresses the transfer on the reader side."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pdxfer.transport.base import PeerDied, ReadHandle, ReadState, TransferCancelled, TransferTimeout, TransportError

if TYPE_CHECKING:
    from pdxfer.transport.nixl.transport import NixlTransport


class NixlReadHandle(ReadHandle):
    def __init__(self, transport: "NixlTransport", peer: str, xfer: Any, nbytes: int,
                 state: ReadState = ReadState.PENDING, error: TransportError | None = None):
        self._t = transport
        self.peer = peer
        self._xfer = xfer
        self.nbytes = nbytes
        self._state = state
        self._error = error

    @property
    def error(self) -> TransportError | None:
        return self._error

    def _finish(self, state: ReadState, error: TransportError | None = None) -> None:
        self._state, self._error = state, error
        xfer, self._xfer = self._xfer, None
        self._t._forget(self)
        if xfer is not None:
            self._t._release_xfer(xfer)

    def poll(self) -> ReadState:
        if self._state is not ReadState.PENDING:
            return self._state
        t = self._t
        try:
            with t._lock:
                if self._xfer is None:  # closed under us
                    return self._state
                st = t._agent.check_xfer_state(self._xfer)
        except t._bind.nixlRemoteDisconnectError as exc:
            self._finish(ReadState.FAILED, PeerDied(f"NIXL peer {self.peer} disconnected during READ: {exc}"))
            return self._state
        except Exception as exc:
            self._finish(ReadState.FAILED, PeerDied(f"NIXL READ from {self.peer} failed: {exc!r}"))
            return self._state
        if st == "DONE":
            self._finish(ReadState.DONE)
        elif st == "ERR":
            self._finish(ReadState.FAILED,
                         PeerDied(f"NIXL READ from {self.peer} failed (ERR): peer died or connection lost"))
        return self._state

    def wait(self, timeout: float) -> ReadState:
        deadline = time.monotonic() + max(0.0, timeout)
        # Spin briefly (CMA and small READs finish within microseconds), then back off so a waiting
        # reader does not burn a core for a long transfer. Polling is what progresses the READ.
        spins, sleep = 0, 0.0
        while self.poll() is ReadState.PENDING:
            now = time.monotonic()
            if now - self._t._last_wake(self.peer) > self._t._hot_window / 2:
                self._t._wake(self.peer)  # a long READ must keep the holder's progress hot
            if now >= deadline:
                raise TransferTimeout(f"NIXL READ of {self.nbytes} bytes from {self.peer} still pending "
                                      f"after {timeout:.3f} s")
            spins += 1
            if spins > 200:
                sleep = min(0.001, max(5e-5, sleep * 2))
                time.sleep(sleep)
        if self._state is ReadState.FAILED:
            assert self._error is not None
            raise self._error
        if self._state is ReadState.CANCELLED:
            raise self._error or TransferCancelled(f"READ from {self.peer} was cancelled")
        return self._state

    def cancel(self) -> None:
        if self._state is ReadState.PENDING:
            self._finish(ReadState.CANCELLED, TransferCancelled(f"READ from {self.peer} was cancelled"))
