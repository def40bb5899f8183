"""Waiting for a hinted publish off vLLM's scheduler thread.

A decode whose prefill announced chunks (the publish hint) that its first lookup did not find
waits for them, at most ``publish_hint_wait_s`` of wall clock from that miss. The lookups of
the wait run here, on one background thread; the scheduler thread only reads their latest
answer, so a slow master costs it nothing and N waiting requests cost it no round trips.

Each waiting request keeps its latest answer (and that answer's lock: a partial hit is what the
request goes on with when its bound passes); a newer answer replaces it and the older lock is
given back. An answer that arrives after its request stopped waiting is given back at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("pdxfer.vllm.scheduler")


@dataclass
class HintWait:
    """One request waiting for a hinted publish."""

    want: list[bytes]  # the keys its lookups ask for
    expected: int  # leading keys the hint covers: the wait ends once a lookup finds them
    since: float  # monotonic: the first lookup that missed them
    until: float  # monotonic: past this the request goes on with what is there
    context: Any  # what the reader needs to answer with ``result``
    result: Any  # the latest lookup's answer (its lock is held), or None
    answered_at: float = 0.0  # wall clock of that answer (its lock's TTL runs from then)
    lookups: int = 0  # lookups made while waiting
    errors: int = 0  # ... that failed
    done: bool = False  # a lookup found every expected key


class HintPoller:
    """Looks up waiting requests in the background until their chunks are there or their bound
    passes. ``lookup(want)`` is one master lookup (bounded by the client's timeout);
    ``release(lock_id)`` gives back a lock nobody will read under."""

    def __init__(self, lookup: Callable[[list[bytes]], Any], release: Callable[[str], None],
                 retry_s: float) -> None:
        self._lookup = lookup
        self._release = release
        self._retry_s = retry_s
        self._mu = threading.Lock()
        self._waits: dict[str, HintWait] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._waits

    def start(self, req_id: str, wait: HintWait) -> None:
        with self._mu:
            if self._closed:
                raise RuntimeError("hint poller is closed")
            old = self._waits.pop(req_id, None)
            self._waits[req_id] = wait
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdxfer-hint-wait", daemon=True)
                self._thread.start()
        self._give_back(old.result if old is not None else None)
        self._wake.set()

    def take_if_over(self, req_id: str, now: float) -> HintWait | None:
        """The request's wait when it is over (its chunks were found, or its bound passed),
        removed: the caller owns its result's lock. None while it still waits. Never blocks on
        the master (a lookup in flight is not waited for)."""
        with self._mu:
            w = self._waits.get(req_id)
            if w is None or not (w.done or now >= w.until):
                return None
            del self._waits[req_id]
            return w

    def cancel(self, req_id: str) -> None:
        with self._mu:
            w = self._waits.pop(req_id, None)
        if w is not None:
            self._give_back(w.result)

    def close(self) -> None:
        with self._mu:
            self._closed = True
            waits, self._waits = list(self._waits.values()), {}
        self._wake.set()
        for w in waits:
            self._give_back(w.result)

    def _give_back(self, res: Any) -> None:
        if res is not None and res.lock_id is not None:
            self._release(res.lock_id)

    def _run(self) -> None:
        while True:
            with self._mu:
                if self._closed:
                    return
                now = time.monotonic()
                due = [(rid, w) for rid, w in self._waits.items() if not w.done and now < w.until]
            if not due:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            for rid, w in due:
                self._poll(rid, w)
            # Between passes: the master is asked at most every retry_s per waiting request.
            self._wake.wait(self._retry_s)
            self._wake.clear()

    def _poll(self, rid: str, w: HintWait) -> None:
        if time.monotonic() >= w.until:
            return
        try:
            res = self._lookup(w.want)
            answered_at = time.time()
            failed = False
        except Exception as exc:  # a master error: the wait goes on with the answer it has
            log.debug("pdxfer: lookup while %s waits for a hinted publish failed: %s", rid, exc)
            res, failed, answered_at = None, True, 0.0
        with self._mu:
            live = self._waits.get(rid) is w and not self._closed
            if live:
                w.lookups += 1
                w.errors += failed
                if res is not None:
                    res, w.result = w.result, res  # keep the newest; give the older back
                    w.answered_at = answered_at
                    w.done = w.result.hit_chunks >= w.expected
        self._give_back(res)
