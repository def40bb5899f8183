"""Backends found by DNS: ``dns+http://NAME:PORT`` (or ``dns+https://``) stands for every address
NAME resolves to, each one a backend ``http://<address>:PORT`` of its own.

A Service that load-balances hides its pods behind one address, so the proxy could neither send
a prompt to the pod holding its prefix nor take one bad pod out. A headless Service (Kubernetes)
or any name with several A/AAAA records lists the pods themselves; the proxy resolves it again
every ``interval_s``:

- a new address becomes a backend (in rotation at once; the health checks take it from there);
- a vanished one leaves the rotation at once and is dropped once nothing is in flight to it, so
  a request under way finishes where it started;
- a failed resolution (timeout, no such name, no DNS server) keeps the last known addresses and
  is logged once, until the name resolves again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

from pdxfer.serve.backends import Backend, BackendPool

log = logging.getLogger("pdxfer.proxy")

DNS_SCHEMES = {"dns+http": "http", "dns+https": "https"}


@dataclass(frozen=True)
class DnsSource:
    """One ``dns+http(s)://NAME:PORT`` backend of one role."""

    role: str
    spec: str  # as given, for logs and /health
    scheme: str  # http | https
    name: str
    port: int

    def url_for(self, address: str) -> str:
        if ":" in address:  # IPv6; a zone (fe80::1%eth0) is written %25 inside a URL
            address = "[" + address.replace("%", "%25") + "]"
        return f"{self.scheme}://{address}:{self.port}"


def is_dns_spec(url: str) -> bool:
    return isinstance(url, str) and url.split("://", 1)[0] in DNS_SCHEMES and "://" in url


def parse_dns_spec(role: str, url: str) -> DnsSource:
    """The source a ``dns+http(s)://NAME:PORT`` backend names; ValueError saying what is wrong."""
    what = f"{role} backend {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if parts.scheme not in DNS_SCHEMES:
        raise ValueError(f"{what}: a DNS backend starts with dns+http:// or dns+https://")
    if not parts.hostname:
        raise ValueError(f"{what}: no name to resolve (dns+http://NAME:PORT)")
    if port is None:
        raise ValueError(f"{what}: needs a port (dns+http://NAME:PORT): every address gets it")
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{what}: only dns+http://NAME:PORT (no user, path, query or fragment)")
    return DnsSource(role, url.rstrip("/"), DNS_SCHEMES[parts.scheme], parts.hostname, port)


def split_specs(role: str, specs: Sequence[str]) -> tuple[list[str], list[DnsSource]]:
    """(plain URLs, DNS sources) of one role's backends; ValueError when there are none or a DNS
    backend is malformed or given twice (plain URLs are checked by the pool)."""
    if not specs:
        raise ValueError(f"no {role} instance given")
    urls = [u for u in specs if not is_dns_spec(u)]
    sources = [parse_dns_spec(role, u) for u in specs if is_dns_spec(u)]
    seen = [s.spec for s in sources]
    dup = sorted({x for x in seen if seen.count(x) > 1})
    if dup:
        raise ValueError(f"{role} backend given twice: {', '.join(dup)}")
    return urls, sources


def addresses(infos: Iterable[tuple]) -> list[str]:
    """The distinct IPv4/IPv6 addresses of a getaddrinfo answer, in its order."""
    out: list[str] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and sockaddr[0] not in out:
            out.append(sockaddr[0])
    return out


OnAdded = Callable[[Backend], None]
OnRemoved = Callable[[Backend], None]


class Discovery:
    """Keeps the pools' DNS-found backends in step with what their names resolve to."""

    def __init__(self, pools: Sequence[BackendPool], sources: Sequence[DnsSource],
                 interval_s: float = 5.0, timeout_s: float = 2.0,
                 on_added: OnAdded | None = None, on_removed: OnRemoved | None = None) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"discovery interval and timeout must be positive, got "
                             f"{interval_s:g} and {timeout_s:g}")
        self.pools = {p.role: p for p in pools}
        unknown = [s.spec for s in sources if s.role not in self.pools]
        if unknown:
            raise ValueError(f"DNS backends of no pool: {unknown}")
        self.sources = list(dict.fromkeys(sources))
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_added = on_added
        self.on_removed = on_removed
        self.known: dict[DnsSource, list[str]] = {s: [] for s in self.sources}  # last good answer
        self.failing: dict[DnsSource, str] = {}  # sources whose last resolution failed, and why
        self._owned: dict[str, set[str]] = {role: set() for role in self.pools}  # URLs we added
        # A resolution that outlived its timeout still holds an executor thread: no second one
        # for that name until it is done.
        self._pending: dict[DnsSource, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    async def resolve(self, source: DnsSource) -> list[str]:
        """The backend URLs ``source`` names now; OSError or TimeoutError when it cannot tell."""
        task = self._pending.get(source)
        if task is not None and not task.done():
            raise TimeoutError(f"the previous resolution of {source.name} is still running")
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.getaddrinfo(source.name, source.port, type=socket.SOCK_STREAM))
        # One that timed out ends unawaited: take its outcome so asyncio does not report it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._pending[source] = task
        try:
            infos = await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {self.timeout_s:g} s") from None
        # Keep the order of the answer but not its repeats (one record per address and type).
        return [source.url_for(a) for a in addresses(infos)]

    async def _refresh_source(self, source: DnsSource) -> None:
        try:
            urls = await self.resolve(source)
        except (OSError, TimeoutError) as e:
            why = f"{e.__class__.__name__}: {e}"
            if source not in self.failing:
                log.warning("%s: resolving %s failed (%s); keeping its last known %d instance(s) "
                            "until it resolves again", source.role, source.spec, why,
                            len(self.known[source]))
            self.failing[source] = why
            return
        if self.failing.pop(source, None) is not None:
            log.info("%s: %s resolves again", source.role, source.spec)
        self.known[source] = urls

    async def refresh(self) -> None:
        """Resolve every name once (concurrently), then add and retire backends to match."""
        await asyncio.gather(*(self._refresh_source(s) for s in self.sources))
        for role, pool in self.pools.items():
            want: dict[str, DnsSource] = {}
            for s in self.sources:
                if s.role == role:
                    for u in self.known[s]:
                        want.setdefault(u, s)
            self._apply(pool, want)

    def _apply(self, pool: BackendPool, want: dict[str, DnsSource]) -> None:
        owned = self._owned[pool.role]
        for url, source in want.items():
            b = pool.by_url(url)
            if b is None:
                b = pool.add(url, source=source.spec)
                owned.add(url)
                log.info("%s instance %s found through %s: in rotation", pool.role, url, source.spec)
                if self.on_added is not None:
                    self.on_added(b)
            elif url in owned and b.draining:
                b.draining = False
                log.info("%s instance %s is back in %s: in rotation again", pool.role, url, source.spec)
            # else: given as a static URL as well; that one stays, whatever DNS says.
        for url in sorted(owned - set(want)):
            b = pool.by_url(url)
            if b is not None and not b.draining:
                b.draining = True
                log.info("%s instance %s no longer in DNS: out of rotation, dropped once nothing "
                         "is in flight to it (%d now)", pool.role, url, b.in_flight)
        self.sweep()

    def sweep(self) -> None:
        """Drop the retired backends that have nothing in flight."""
        for role, pool in self.pools.items():
            for b in pool.drop_idle_draining():
                self._owned[role].discard(b.url)
                log.info("%s instance %s dropped", role, b.url)
                if self.on_removed is not None:
                    self.on_removed(b)

    def describe(self) -> list[dict[str, Any]]:
        """Each name, what it resolved to last, and why its last resolution failed (if it did)."""
        return [{"role": s.role, "backend": s.spec, "instances": list(self.known[s]),
                 "error": self.failing.get(s, "")} for s in self.sources]

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval_s)
                try:
                    await self.refresh()
                except Exception:  # noqa: BLE001 - discovery must outlive one bad round
                    log.exception("backend discovery failed; trying again in %g s", self.interval_s)

        self._task = asyncio.get_running_loop().create_task(loop(), name="pdxfer-discovery")

    async def stop(self) -> None:
        for t in [self._task, *self._pending.values()]:
            if t is not None and not t.done():
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                    pass
