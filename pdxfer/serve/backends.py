"""The proxy's instances: who they are, whether they are healthy, how loaded, and which to pick.

An instance is taken out when its health check (GET /health) fails or times out, or when a
request could not reach it (refused, reset, disconnected); the next passing health check puts it
back. Nothing here sends a request: the proxy does (proxy.py), the checker only asks /health.

A pool may change while the proxy runs (backends found through DNS, discovery.py): a backend
leaving it is first ``draining`` (never picked again) and dropped once nothing is in flight to it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import aiohttp

from pdxfer.serve.periodic import start_periodic, stop_periodic

log = logging.getLogger("pdxfer.proxy")

POLICIES = ("round_robin", "least_loaded")
ROLES = ("prefill", "decode")


@dataclass
class Backend:
    url: str
    role: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    healthy: bool = True
    down_reason: str = ""  # why it was taken out (empty while healthy)
    changed_at: float = field(default_factory=time.monotonic)
    source: str = ""  # the dns+http:// backend it was found through ("" when given as a URL)
    draining: bool = False  # gone from DNS: picked no more, dropped once nothing is in flight
    drain_requested: bool = False  # an operator drains it (pdxfer drain): picked no more, kept listed
    removed: bool = False  # dropped from its pool (late updates of its metrics are ignored)

    @property
    def in_rotation(self) -> bool:
        """Healthy and not draining: new requests may go to it."""
        return self.healthy and not self.draining and not self.drain_requested

    def mark_down(self, reason: str) -> bool:
        """Take it out; True when it was in (so the caller logs and counts once)."""
        self.down_reason = reason
        if not self.healthy:
            return False
        self.healthy, self.changed_at = False, time.monotonic()
        return True

    def mark_up(self) -> bool:
        """Put it back; True when it was out. A drained instance that went down and is back
        (restarted) is in rotation again: a drain lasts until the instance's restart."""
        if self.healthy:
            return False
        self.healthy, self.down_reason, self.changed_at = True, "", time.monotonic()
        self.drain_requested = False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "down_reason": self.down_reason, "in_flight": self.in_flight,
                "requests": self.requests, "errors": self.errors,
                "draining": self.draining or self.drain_requested,
                **({"source": self.source} if self.source else {})}


def check_url(role: str, url: str) -> str:
    """The URL without a trailing slash; ValueError naming the role when it is no http(s) URL."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{role} instance URL must start with http:// or https:// (or "
                         f"dns+http:// for every address of a name): {url!r}")
    return url.rstrip("/")


@dataclass
class BackendPool:
    """Instances of one role and the choice between them (healthy ones only)."""

    role: str
    backends: list[Backend]
    policy: str = "least_loaded"
    _turn: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def from_urls(cls, role: str, urls: Sequence[str], policy: str,
                  allow_empty: bool = False) -> "BackendPool":
        """``allow_empty``: the pool is filled later (DNS discovery)."""
        if not urls and not allow_empty:
            raise ValueError(f"no {role} instance given")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        clean = [check_url(role, u) for u in urls]
        dup = sorted({u for u in clean if clean.count(u) > 1})
        if dup:
            raise ValueError(f"{role} instance given twice: {', '.join(dup)}")
        return cls(role, [Backend(u, role) for u in clean], policy)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.in_rotation]

    def add(self, url: str, source: str = "") -> Backend:
        """A new backend in rotation (healthy until its health check says otherwise)."""
        url = check_url(self.role, url)
        if self.by_url(url) is not None:
            raise ValueError(f"{self.role} instance {url} is in the pool already")
        b = Backend(url, self.role, source=source)
        self.backends.append(b)
        return b

    def drop_idle_draining(self) -> list[Backend]:
        """Remove the draining backends with nothing in flight; those removed."""
        gone = [b for b in self.backends if b.draining and b.in_flight == 0]
        if gone:
            self.backends = [b for b in self.backends if not (b.draining and b.in_flight == 0)]
            for b in gone:
                b.removed = True
        return gone

    def by_url(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.backends if b.url == url), None)

    def pick(self, exclude: Iterable[Backend] = (), last_resort: bool = False) -> Backend | None:
        """A healthy instance not in ``exclude`` by the pool's policy (ties take turns), or None.
        ``last_resort``: any instance not in ``exclude``, healthy or not (for when none is: one
        taken out for a slow health check may well answer, and one that does not is named)."""
        skip = {id(b) for b in exclude}
        n = len(self.backends)
        if n == 0:  # DNS found none (yet)
            return None
        start = next(self._turn) % n
        order = [b for b in self.backends[start:] + self.backends[:start]
                 if (b.healthy or last_resort) and not b.draining and not b.drain_requested
                 and id(b) not in skip]
        if not order:
            return None
        if self.policy == "round_robin":
            return order[0]
        return min(order, key=lambda b: b.in_flight)

    def describe_down(self) -> str:
        if not self.backends:
            return "none known"
        return "; ".join(f"{b.url}: {b.down_reason or ('draining' if b.draining or b.drain_requested else 'out')}"
                         for b in self.backends if not b.in_rotation)


def load_backends_file(path: str | Path) -> tuple[list[str], list[str]]:
    """(prefill URLs, decode URLs) from a JSON file ``{"prefill": [...], "decode": [...]}``."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"backends file {p}: cannot read it: {e}") from None
    except ValueError as e:
        raise ValueError(f"backends file {p} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"backends file {p} must hold an object with \"prefill\" and \"decode\" lists")
    unknown = sorted(set(doc) - set(ROLES))
    if unknown:
        raise ValueError(f"backends file {p}: unknown key(s) {unknown}; known: prefill, decode")
    out: list[list[str]] = []
    for role in ROLES:
        urls = doc.get(role, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"backends file {p}: \"{role}\" must be a list of URLs")
        out.append(urls)
    return out[0], out[1]


OnChange = Callable[[Backend, bool], None]


class HealthChecker:
    """GET /health on every instance every ``interval_s`` (each bounded by ``timeout_s``)."""

    def __init__(self, pools: Sequence[BackendPool], interval_s: float, timeout_s: float,
                 on_change: OnChange | None = None) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("health check interval and timeout must be positive")
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    async def check(self, session: aiohttp.ClientSession, b: Backend) -> None:
        try:
            async with session.get(b.url + "/health",
                                   timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                await r.read()
                ok, why = r.status == 200, f"health check answered HTTP {r.status}"
        except asyncio.TimeoutError:
            ok, why = False, f"health check timed out after {self.timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            ok, why = False, f"health check failed: {e.__class__.__name__}: {e}"
        changed = b.mark_up() if ok else b.mark_down(why)
        if changed:
            if ok:
                log.info("%s instance %s is healthy again: back in", b.role, b.url)
            else:
                log.warning("%s instance %s taken out: %s", b.role, b.url, why)
            if self.on_change is not None:
                self.on_change(b, ok)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, b) for pool in self.pools for b in pool.backends))

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = start_periodic("pdxfer-health", self.interval_s, lambda: self.check_all(session))

    async def stop(self) -> None:
        await stop_periodic(self._task)
