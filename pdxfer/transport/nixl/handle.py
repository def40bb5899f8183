"""The handle of one NIXL READ: polling it is what progresses the transfer on the reader side."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pdxfer.transport.base import PeerDied, ReadHandle, ReadState, TransferCancelled, TransferTimeout, TransportError

if TYPE_CHECKING:
    from pdxfer.transport.nixl.transport import NixlTransport

log = logging.getLogger(__name__)


class NixlReadHandle(ReadHandle):
    def __init__(self, transport: "NixlTransport", peer: str, xfer: Any, nbytes: int,
                 state: ReadState = ReadState.PENDING, error: TransportError | None = None):
        self._t = transport
        self.peer = peer
        self._xfer = xfer
        self.nbytes = nbytes
        self._state = state
        self._error = error
        self._cancelling = False  # cancel() asked, but NIXL could not stop the transfer yet

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
        if self._cancelling:
            self._try_stop()
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
        # Polling is what progresses the READ (UCX hands queued work requests to the NIC, and
        # sees the last completion, only inside progress), but a waiter polling back to back takes
        # a core the holder may need on the same host: the soft-RoCE ladder measured the sleeping
        # wait (up to wait_backoff_s between polls) at 0.99x raw NIXL against 0.88x back to back.
        backoff = self._t._wait_backoff
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
                if backoff > 0:
                    sleep = min(backoff, max(5e-5, sleep * 2))
                    time.sleep(sleep)
                elif not spins & 255:
                    time.sleep(0)  # let other threads and processes (the holder, on one host) run
        if self._state is ReadState.FAILED:
            assert self._error is not None
            raise self._error
        if self._state is ReadState.CANCELLED:
            raise self._error or TransferCancelled(f"READ from {self.peer} was cancelled")
        return self._state

    def cancel(self) -> None:
        """Stop the READ. The handle says CANCELLED only once NIXL released the transfer (or it
        ended): until then bytes may still land, so it stays PENDING and poll() tries again."""
        if self._state is ReadState.PENDING:
            self._cancelling = True
            self._try_stop()

    def _try_stop(self) -> None:
        t = self._t
        with t._lock:
            xfer = self._xfer
            if xfer is not None:
                try:
                    xfer.release()  # raises while NIXL cannot abort the transfer yet
                except Exception as exc:
                    if not self._ended(xfer):
                        log.debug("NIXL READ from %s not stopped yet: %r", self.peer, exc)
                        return
                    t._leaked.append(xfer)  # over, but not releasable now: release at close
            self._xfer = None
        self._state, self._error = ReadState.CANCELLED, TransferCancelled(f"READ from {self.peer} was cancelled")
        t._forget(self)

    def _ended(self, xfer: Any) -> bool:
        """The transfer can write nothing more: it completed, failed, or its peer is gone."""
        try:
            return self._t._agent.check_xfer_state(xfer) in ("DONE", "ERR")
        except self._t._bind.nixlRemoteDisconnectError:
            return True
        except Exception:
            return False
