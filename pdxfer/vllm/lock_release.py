"""Giving a reader lock nobody will read under back to the master off the hot path, for both
halves of the connector (the scheduler's unused lookups, the worker's failed loads).

The master's answer changes nothing for the caller and the lock expires on its own, so the call
runs on an executor's thread, a failure is only logged, and a call made while the executor shuts
down is dropped.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Any, Callable

log = logging.getLogger(__name__)


def release_off_path(executor: Executor, release: Callable[..., Any], lock_id: str,
                     all_parties: bool = False) -> None:
    """Call ``release(lock_id, all_parties=...)`` (a :meth:`MasterClient.release`) on ``executor``;
    returns at once. An empty ``lock_id`` (no lock was taken) is nothing to give back."""
    if not lock_id:
        return

    def run() -> None:
        try:
            release(lock_id, all_parties=all_parties)
        except Exception as exc:  # expiry covers it
            log.debug("pdxfer: release of unused lock %s failed: %s", lock_id, exc)

    try:
        executor.submit(run)
    except RuntimeError:  # shutting down
        pass


__all__ = ["release_off_path"]
