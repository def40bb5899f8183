"""The holder's reaper: the background thread that gives held chunks back once their retention
is over and the master's compare-and-unpublish confirmed no reader can lock them any more.

It sleeps until the next retention deadline (no polling: an idle engine costs nothing), moves
chunks with a complete host copy to the host tier instead of unpublishing them, and frees a chunk
the master never confirmed gone only as a last resort (long past any lock it could have granted,
or once the master has been unreachable for longer than the lease and the lock TTL cap). The
blocks themselves are returned to vLLM on the scheduler thread (``HolderPath.drain_frees``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from pdxfer.master import MasterError

if TYPE_CHECKING:
    from pdxfer.vllm.scheduler.holder import HolderPath

log = logging.getLogger("pdxfer.vllm.scheduler")


class Reaper:
    """The reaper of one ``HolderPath``; works on its held chunks under its ``_lock``."""

    def __init__(self, holder: HolderPath) -> None:
        self._h = holder
        self._thread: threading.Thread | None = None
        self._master_unreachable_since: float | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pdxfer-reaper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Unpublish chunks whose retention is over; sleeps until the next deadline (no polling).
        Survives any error: a dead reaper would never return held blocks to vLLM."""
        hp = self._h
        while True:
            try:
                if self._step():
                    return
            except Exception as exc:
                hp.stats.background_errors += 1
                log.exception("pdxfer: the holder's reaper hit an unexpected error (retrying in 1 s): %s", exc)
                with hp._lock:
                    if hp._closing:
                        return
                    hp._wake.wait(1.0)

    def _step(self) -> bool:
        """One round of the reaper; True when the holder is closing."""
        hp = self._h
        with hp._lock:
            if hp._closing:
                return True
            now = time.monotonic()
            # Not those a pressure reclaim is unpublishing: one unpublish, and one owner of the mark, per chunk.
            due = [k for k, h in hp._held.items() if h.retain_until <= now and not h.moving and not h.leaving]
            if not due:
                nxt = min((h.retain_until for h in hp._held.values() if not h.leaving), default=None)
                hp._wake.wait(None if nxt is None else max(nxt - now, 0.01))
                return False
            # Chunks with a complete host copy move there instead (on the publisher thread).
            moves = hp.host_tier.mark_moving(due, retention_over=True)
            for k in moves:
                h = hp._held[k]
                h.retention_end = h.retention_end or now
            due = [k for k in due if k not in moves]
            hp._mark_leaving(due)
        assert hp.node_id is not None
        if moves:
            hp.host_tier.submit_move(moves)
            if not due:
                return False
        try:
            return self._unpublish_due(due, now)
        finally:
            with hp._lock:
                hp._mark_leaving(due, False)

    def _unpublish_due(self, due: list[bytes], now: float) -> bool:
        """The reaper's unpublish of chunks past their retention (marked leaving); True when closing."""
        hp = self._h
        try:
            done = hp._unpublish(hp._bg, due)
            self._master_unreachable_since = None
            # The master reports keys it never had as gone, so "not removed" means locked.
            # Past its retention an entry is never served, so no lock on it can be newer than
            # its retention end: after a generous multiple of the lock TTL the key is freed
            # anyway, a last resort should a master misbehave.
            gone = set(done)
            with hp._lock:
                stale = [k for k in due if k not in gone and k in hp._held
                         and now - (hp._held[k].retention_end or now) > hp.stale_after_s]
            if stale:
                log.warning("pdxfer: %d held chunks were never confirmed unpublished; freeing them",
                            len(stale))
                done = list(done) + stale
        except MasterError as exc:
            done = []
            t0 = self._master_unreachable_since = self._master_unreachable_since or now
            # After lease + the lock TTL cap without any answer from the master (heartbeats
            # count), it has dropped our entries and every lock it granted has expired: freeing
            # can no longer hand a reader wrong bytes.
            last_ok = hp._session.last_ok_at if hp._session is not None else None
            if now - max(t0, last_ok or 0.0) > hp.cfg.lease_ttl_s + hp.max_lock_ttl_s:
                log.warning("pdxfer: master unreachable for %.0f s (%s): freeing %d held chunks",
                            now - t0, exc, len(due))
                done = due
        hp._forget(done, only_if_due=True)
        with hp._lock:
            # Locked (or not yet unpublishable) chunks: try again shortly, not in a tight loop.
            retry = time.monotonic() + min(1.0, hp.cfg.lock_ttl_s)
            for k in due:
                h = hp._held.get(k)
                if h is not None and h.retain_until <= now:  # not re-published meanwhile
                    h.retention_end = h.retention_end or now
                    h.retain_until = retry
            if hp._closing:
                return True
            hp._wake.wait(0.05 if done else 0.0)
        return False
