"""pdxfer-master: the chunk index (key -> holder node, block ids) and its lifetime rules.

Client API, imported from this package: ``MasterClient`` (client/master_client.py), ``NodeSession``
(client/node_session.py), ``start_local_master`` / ``LocalMaster`` (local.py), the records and errors
it returns and raises. They resolve on first use (module ``__getattr__``), so a module of the server,
the wire or the backends does not load the client with its package. Module map: docs/master.md.

CLI (console script ``pdxfer-master``, or ``python -m pdxfer.master.service``)::

    pdxfer-master [--host 127.0.0.1] [--port 0] [--port-file F]
                  [--http-host H] [--http-port 0|-1] [--advertise HOST:PORT]
                  [--token-file F]
                  [--etcd HOST:PORT[,HOST:PORT]] [--etcd-prefix /pdxfer/master]
                  [--leader-ttl 5] [--etcd-timeout 1]
                  [--etcd-ca F] [--etcd-cert F --etcd-key F] [--etcd-user U --etcd-password-file F]
                  [--chunk-tokens 256] [--max-entries 10000000] [--max-lock-ttl 30]
                  [--max-connections 4096] [--handshake-timeout 10] [--idle-timeout 600]
                  [--log-level INFO]

--host / --port      wire-protocol listen address; port 0 lets the OS choose.
--port-file F        once listening, F is (atomically) written as "<wire port>\\n<http port>\\n".
--http-host/--http-port
                     ``GET /metrics`` (Prometheus text) and ``GET /health`` (JSON: status ok |
                     degraded | standby); port 0 = OS-chosen, -1 = no HTTP endpoint.
--token-file F       shared secret; every request must carry it, others are refused and logged.
                     Required to listen on a non-loopback address (or --insecure-no-token).
--etcd ...           HA mode: replicas elect a leader through etcd (lease-held key
                     ``<prefix>/leader`` holding ``{"addr": ADVERTISE, ...}``), the leader mirrors
                     node membership as keys under per-node leases (``<prefix>/nodes/<id>``).
                     Standbys answer "not leader"; clients given ``etcd://host:port/prefix`` follow.
                     If etcd becomes unreachable the leader keeps serving from memory (degraded)
                     only while its lease cannot have expired by its own clock, then answers
                     "not leader" until it leads again.
--advertise          address clients should use to reach this replica (default host:port).
--tls-cert/--tls-key/--tls-client-ca/--http-tls
                     TLS on the wire and HTTP ports, client certificates required with a client
                     CA ($PDXFER_MASTER_TLS_*; docs/master.md). Clients: MasterClient(ca_file=,
                     cert_file=, key_file=, server_name=) or $PDXFER_MASTER_CA_FILE etc.
--etcd-ca/-cert/-key/-user/-password-file/-tls
                     TLS and auth towards etcd, the etcd:// options ca=, cert=, ... (docs/master.md).
--leader-ttl         leader lease TTL (s); renewed every TTL/3 on the remaining time.
--max-lock-ttl       cap on reader lock TTLs (s); announced in register replies, so holders know
                     how long a lock can pin their blocks.
--max-connections    concurrent client connections; at the cap the oldest one that has not proven
                     itself is cut for a newcomer; only proven clients filling it refuse one.
--max-unproven-per-peer  connections one address may hold before proving itself (oldest cut).
--handshake-timeout  seconds a new connection has to send its first frame (hello with the token).
--idle-timeout       seconds an authenticated connection may stay idle.
--chunk-tokens       only used to report hit tokens (hit chunks x chunk tokens).

Without ``--etcd`` it is one process with everything in memory.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "MasterClient": "pdxfer.master.client.master_client",
    "Registrations": "pdxfer.master.client.registrations",
    "NodeSession": "pdxfer.master.client.node_session",
    "LocalMaster": "pdxfer.master.local",
    "start_local_master": "pdxfer.master.local",
    **{name: "pdxfer.master.wire.errors" for name in (
        "MasterAuthError", "MasterError", "MasterProtocolError", "MasterUnavailable", "NotLeader",
        "PublishFenced", "RegistrationSuperseded", "UnknownNode")},
    **{name: "pdxfer.master.wire.records" for name in (
        "ChunkLocation", "LookupResult", "NodeInfo", "PeekResult", "RankEndpoint", "Registration")},
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'pdxfer.master' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "ChunkLocation",
    "LocalMaster",
    "LookupResult",
    "MasterAuthError",
    "MasterClient",
    "MasterError",
    "MasterProtocolError",
    "MasterUnavailable",
    "NodeInfo",
    "RankEndpoint",
    "NodeSession",
    "NotLeader",
    "PeekResult",
    "PublishFenced",
    "Registration",
    "RegistrationSuperseded",
    "Registrations",
    "UnknownNode",
    "start_local_master",
]
