"""Where pdxfer's master keeps its records in etcd, and how they are encoded: the one place both
the writer (the replicas' election, ``etcd_coordinator.py``) and the reader (clients following
``etcd://`` to the leader, ``locator.py``) take the layout from.

    etcd://HOST:PORT[,HOST:PORT]/PREFIX[?OPTIONS]
                                            the URL that names an etcd-coordinated master group;
                                            OPTIONS: TLS and auth (``etcd_security.py``)
    <PREFIX>/leader                         {"addr": "host:port", "id": replica id}, under the
                                            leader's lease; absent while nobody leads
    <PREFIX>/nodes/<node id>                the node's description (as in lookup replies), under
                                            a per-node lease the leader refreshes on heartbeats
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from pdxfer.master.backends.etcd_security import EtcdSecurity, security_from, split_options
from pdxfer.master.wire.protocol import parse_hostport

SCHEME = "etcd://"
DEFAULT_PREFIX = "/pdxfer/master"


@dataclass(frozen=True)
class EtcdTarget:
    endpoints: list[tuple[str, int]]
    prefix: str  # no trailing slash
    security: EtcdSecurity = field(default_factory=EtcdSecurity)


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``host:port[,host:port]`` -> endpoints; ValueError naming the bad one."""
    endpoints = []
    for ep in text.split(","):
        if not ep.strip():
            continue
        try:
            endpoints.append(parse_hostport(ep))
        except ValueError:
            raise ValueError(f"etcd endpoint {ep!r} is not host:port") from None
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return endpoints


def etcd_url(endpoints: str, prefix: str = DEFAULT_PREFIX, security: EtcdSecurity | None = None) -> str:
    """The URL for ``--etcd ENDPOINTS --etcd-prefix PREFIX`` (and the ``--etcd-*`` TLS/auth flags)."""
    return f"{SCHEME}{endpoints}/{prefix.strip('/')}" + (security.query() if security else "")


def parse_etcd_url(url: str, env: Mapping[str, str] | None = None) -> EtcdTarget:
    """``etcd://host:port[,host:port][/prefix][?options]`` -> endpoints, prefix (default
    /pdxfer/master) and TLS/auth settings (options not in the URL come from ``env``, default the
    process environment); ValueError naming what is wrong."""
    if not url.startswith(SCHEME):
        raise ValueError(f"{url!r} is not an {SCHEME}... URL")
    rest, _, query = url[len(SCHEME) :].partition("?")
    hosts, _, prefix = rest.partition("/")
    return EtcdTarget(parse_endpoints(hosts), "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX,
                      security_from(split_options(query), env))


def leader_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/leader".encode()


def node_key(prefix: str, node_id: str) -> bytes:
    return f"{prefix.rstrip('/')}/nodes/{node_id}".encode()


@dataclass(frozen=True)
class LeaderRecord:
    addr: str  # host:port clients connect to
    replica_id: str


def encode_leader(addr: str, replica_id: str) -> bytes:
    return json.dumps({"addr": addr, "id": replica_id}).encode()


def decode_leader(value: bytes) -> LeaderRecord:
    """ValueError naming what is wrong when the value is not a leader record."""
    try:
        doc = json.loads(value)
        addr, replica_id = doc["addr"], doc["id"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"leader record {value[:80]!r} is malformed: {exc!r}") from None
    if not isinstance(addr, str) or not isinstance(replica_id, str):
        raise ValueError(f"leader record {value[:80]!r}: 'addr' and 'id' must be strings")
    parse_hostport(addr)
    return LeaderRecord(addr, replica_id)
