"""A background step the proxy repeats on its event loop (health checks, load-cost reads)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable


def start_periodic(name: str, interval_s: float, step: Callable[[], Awaitable[None]]) -> asyncio.Task:
    """Run ``step`` now, then again ``interval_s`` after each run ends, until the task is cancelled
    (a slow step delays the next one instead of piling runs up)."""
    async def loop() -> None:
        while True:
            await step()
            await asyncio.sleep(interval_s)

    return asyncio.get_running_loop().create_task(loop(), name=name)


async def stop_periodic(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: never started) and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
