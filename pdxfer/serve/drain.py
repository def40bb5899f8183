"""Drain: an operator takes one instance out of the proxy's rotation before stopping it.

``POST /pdxfer/drain`` with ``{"url": INSTANCE}`` (``"undo": true`` puts it back) marks the instance
draining: no new request goes to it, the requests it has in flight finish, and ``GET
/pdxfer/drain?url=INSTANCE`` says how many are left (``pdxfer drain`` polls it). Stopping the
instance then loses nothing: its connector deregisters from the master before its memory goes, so
its chunks are unpublished first. A drain lasts until the instance goes down and is healthy again
(a restart): then it is back in rotation by itself.

Only the fleet's operator may drain: the proxy's operator middleware (:mod:`pdxfer.serve.
operator_view`: a client on the proxy's own host, or one with the fleet's token as ``Authorization:
Bearer``) answers everyone else 401 before this endpoint runs, so nobody else learns anything.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from aiohttp import web

from pdxfer.serve.backends import Backend, BackendPool

log = logging.getLogger("pdxfer.proxy")

DRAIN_PATH = "/pdxfer/drain"


class DrainEndpoint:
    """The drain endpoint of one proxy over its prefill and decode pools."""

    def __init__(self, pools: Sequence[BackendPool]) -> None:
        self._pools = pools

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(DRAIN_PATH, self.post)
        app.router.add_get(DRAIN_PATH, self.get)

    def _find(self, url: Any) -> Backend | None:
        if not isinstance(url, str):
            return None
        return next((b for pool in self._pools if (b := pool.by_url(url)) is not None), None)

    @staticmethod
    def _state(b: Backend) -> dict[str, Any]:
        return {"url": b.url, "role": b.role, "draining": b.drain_requested, "in_flight": b.in_flight,
                "healthy": b.healthy}

    async def post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the drain request body must be JSON: {\"url\": INSTANCE}")
        if not isinstance(body, dict) or not isinstance(body.get("undo", False), bool):
            return _error(400, "the drain request must be {\"url\": INSTANCE, \"undo\": false|true}")
        b = self._find(body.get("url"))
        if b is None:
            return _error(404, f"no instance {body.get('url')!r} behind this proxy")
        undo = body.get("undo", False)
        if b.drain_requested != (not undo):
            b.drain_requested = not undo
            log.warning("%s instance %s %s (%d requests in flight)", b.role, b.url,
                        "back in rotation" if undo else "draining: no new requests", b.in_flight)
        return web.json_response(self._state(b))

    async def get(self, request: web.Request) -> web.Response:
        b = self._find(request.query.get("url"))
        if b is None:
            return _error(404, f"no instance {request.query.get('url')!r} behind this proxy")
        return web.json_response(self._state(b))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
