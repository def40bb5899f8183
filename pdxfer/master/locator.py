"""Where a client finds the master, chosen by the address's scheme.

``host:port`` names one master. ``etcd://host:port[,host:port]/prefix`` names a replica group:
the current leader's address is read from etcd (through etcd's JSON gateway with the stdlib, so
clients need neither grpc nor an event loop) and read again whenever the client is told to.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from pdxfer.master import etcd_layout
from pdxfer.master.errors import MasterUnavailable
from pdxfer.master.protocol import parse_hostport


class StaticLocator:
    """One master at a fixed address; nothing to follow."""

    follows_leader = False

    def __init__(self, address: str) -> None:
        self.addr = parse_hostport(address)

    def locate(self, timeout_s: float) -> tuple[str, int]:
        return self.addr

    def __str__(self) -> str:
        return "%s:%d" % self.addr


class EtcdLocator:
    """The leader that a replica group publishes in etcd."""

    follows_leader = True

    def __init__(self, url: str) -> None:
        self.target = etcd_layout.parse_etcd_url(url)

    def locate(self, timeout_s: float) -> tuple[str, int]:
        """The leader's address now; MasterUnavailable when no endpoint answers or nobody leads."""
        prefix = self.target.prefix
        key = base64.b64encode(etcd_layout.leader_key(prefix)).decode()
        last: Exception | None = None
        for host, port in self.target.endpoints:
            req = urllib.request.Request(
                f"http://{host}:{port}/v3/kv/range", data=json.dumps({"key": key}).encode(),
                headers={"Content-Type": "application/json"}, method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=max(timeout_s, 0.05)) as resp:
                    doc = json.loads(resp.read())
            except (OSError, urllib.error.URLError, ValueError) as exc:
                last = exc
                continue
            kvs = doc.get("kvs") or []
            if not kvs:
                raise MasterUnavailable(f"no leader published under {prefix} in etcd")
            try:
                return parse_hostport(etcd_layout.decode_leader(base64.b64decode(kvs[0]["value"])).addr)
            except (ValueError, KeyError, TypeError) as exc:
                raise MasterUnavailable(f"leader record under {prefix} in etcd is malformed: {exc}") from None
        raise MasterUnavailable(f"no etcd endpoint answered: {last}")

    def __str__(self) -> str:
        return etcd_layout.SCHEME + ",".join("%s:%d" % ep for ep in self.target.endpoints) + self.target.prefix


def locator_for(address: str) -> StaticLocator | EtcdLocator:
    """ValueError naming the address when it is neither host:port nor an etcd:// URL."""
    if address.startswith(etcd_layout.SCHEME):
        return EtcdLocator(address)
    if "://" in address:
        raise ValueError(f"master address {address!r}: unknown scheme (host:port or {etcd_layout.SCHEME}...)")
    return StaticLocator(address)
