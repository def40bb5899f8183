"""Which headers a proxy passes on (RFC 9110 section 7.6.1: hop-by-hop headers stop at the proxy).

The client's own headers (Authorization for instances started with --api-key, X-Request-Id,
tracing) go to every instance a request visits. Headers describing the bytes on the wire are
dropped because the proxy sends other bytes (the body is re-encoded; aiohttp decompresses).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from multidict import CIMultiDict

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "trailers", "transfer-encoding",
                        "upgrade"})
# The proxy re-encodes the request body and sets its own Host.
_REQUEST_DROP = frozenset({"host", "content-length", "content-encoding", "content-type",
                           "accept-encoding", "expect"})
# The proxy writes the body itself (decompressed, possibly chunked) and sets its own Date/Server.
_RESPONSE_DROP = frozenset({"content-length", "content-encoding", "content-type", "date", "server"})


def _connection_listed(headers: Mapping[str, str]) -> set[str]:
    """Headers the Connection header names: hop-by-hop for this hop only."""
    listed: set[str] = set()
    for k, v in headers.items():
        if k.lower() == "connection":
            listed.update(t.strip().lower() for t in v.split(",") if t.strip())
    return listed


def _keep(headers: Mapping[str, str], drop: Iterable[str]) -> CIMultiDict[str]:
    gone = HOP_BY_HOP | frozenset(drop) | _connection_listed(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in gone:
            out.add(k, v)
    return out


def request_headers(client_headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The client's headers as the proxy sends them to an instance."""
    return _keep(client_headers, _REQUEST_DROP)


def response_headers(upstream_headers: Mapping[str, str]) -> CIMultiDict[str]:
    """An instance's response headers as the proxy passes them to the client."""
    return _keep(upstream_headers, _RESPONSE_DROP)
