"""A minimal asyncio HTTP/1.0 endpoint for ``GET /metrics`` and ``GET /health``.

The stdlib's asyncio streams (the master must not need aiohttp): one request per connection,
bounded request size and read time, anything else answered 404/405/400. ``/metrics`` serves what
the callback renders (prometheus_client's text format). At most ``max_connections`` are open at
once: a newcomer beyond them cuts the oldest connection still waiting for its request, so
sockets that never send one cannot pile up and take the process's file descriptors (the wire
port shares them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections import OrderedDict
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("pdxfer.master.http")

_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_S = 5.0
DEFAULT_MAX_HTTP_CONNECTIONS = 64


def _response(status: str, body: bytes, ctype: str) -> bytes:
    head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


async def serve_http(
    host: str,
    port: int,
    metrics: Callable[[], bytes],
    health: Callable[[], tuple[bool, dict[str, Any]]],
    ssl_context: ssl.SSLContext | None = None,
    max_connections: int = DEFAULT_MAX_HTTP_CONNECTIONS,
    on_cut: Callable[[], None] | None = None,
) -> asyncio.AbstractServer:
    """Serve on ``host:port``; HTTPS with ``ssl_context`` (its handshake bounded like a request
    read); ``on_cut``: called for each connection cut to make room for a newcomer."""
    waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # still reading their request
    open_count = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_count[0] += 1
        if open_count[0] > max_connections and waiting:
            oldest, _ = waiting.popitem(last=False)
            oldest.transport.abort()
            if on_cut is not None:
                on_cut()
        waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                writer.write(_response("400 Bad Request", b"bad request\n", "text/plain"))
                return
            finally:
                waiting.pop(writer, None)
            if len(head) > _MAX_REQUEST_BYTES:
                writer.write(_response("400 Bad Request", b"request too large\n", "text/plain"))
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) != 3:
                writer.write(_response("400 Bad Request", b"bad request line\n", "text/plain"))
                return
            method, path = parts[0], parts[1].split("?", 1)[0]
            if method != "GET":
                writer.write(_response("405 Method Not Allowed", b"only GET\n", "text/plain"))
            elif path == "/metrics":
                writer.write(_response("200 OK", metrics(), CONTENT_TYPE_LATEST))
            elif path == "/health":
                ok, doc = health()
                status = "200 OK" if ok else "503 Service Unavailable"
                writer.write(_response(status, json.dumps(doc).encode() + b"\n", "application/json"))
            else:
                writer.write(_response("404 Not Found", b"try /metrics or /health\n", "text/plain"))
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("http client went away: %s", exc)
        finally:
            open_count[0] -= 1
            waiting.pop(writer, None)
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST_BYTES, ssl=ssl_context,
                                      ssl_handshake_timeout=_READ_TIMEOUT_S if ssl_context else None)
