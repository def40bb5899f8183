"""What the proxy's public port tells whom: clients get answers, only the fleet's operator gets the
fleet's inside (instance URLs, why one is down, metrics, drains).

The operator is any request from the proxy's own host, or one carrying the fleet's token as
``Authorization: Bearer`` (the proxy's ``--master-token-file``; a proxy without a token has no
remote operator). For everyone else the middleware below:

- answers ``/metrics`` and ``/pdxfer/...`` with 401 before anything is looked up (a Prometheus on
  another host scrapes with the token: ``authorization: credentials_file``);
- answers ``/health`` with its status code and a status word only (load balancers need no more);
- drops the ``X-Pdxfer-*`` route headers, which name instances (a streamed answer is sent without
  them: the steps read :data:`OPERATOR_KEY`);
- replaces the proxy's own error answers (marked :data:`PROXY_ERROR_HEADER`) by their status, type
  and a message naming no instance. An instance's own 4xx (the client's error) passes unchanged.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Awaitable, Callable

from aiohttp import web

PROXY_ERROR_HEADER = "X-Pdxfer-Error"
OPERATOR_KEY = "pdxfer_operator"  # set on each request: whether its client is the operator
_OPERATOR_ONLY = ("/metrics", "/pdxfer/")
_GENERIC = {502: "an instance behind this proxy failed the request", 503: "no instance can take the request now",
            504: "an instance behind this proxy timed out"}


class OperatorGate:
    """Tells the fleet's operator from everyone else."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def allows(self, request: web.BaseRequest) -> bool:
        try:
            if ipaddress.ip_address(request.remote or "").is_loopback:
                return True
        except ValueError:
            pass
        if self._token is None:
            return False
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self._token}".encode())


def operator_middleware(gate: OperatorGate) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        request[OPERATOR_KEY] = gate.allows(request)
        if request[OPERATOR_KEY]:
            return await handler(request)
        if request.path.startswith(_OPERATOR_ONLY):
            how = ("send the fleet's token (Authorization: Bearer)" if gate.has_token
                   else "from the proxy's own host only (it has no token)")
            return web.json_response({"error": {"message": f"this endpoint is the fleet operator's: {how}",
                                                "code": 401}}, status=401)
        resp = await handler(request)
        if request.path == "/health" and isinstance(resp, web.Response):
            ok = resp.status == 200
            return web.json_response({"status": "ok" if ok else "unavailable"}, status=resp.status)
        if isinstance(resp, web.Response) and resp.headers.get(PROXY_ERROR_HEADER):
            try:
                etype = json.loads(resp.body)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                etype = "proxy_error"
            resp = web.json_response({"error": {"message": _GENERIC.get(resp.status, "the proxy could not "
                                                                        "serve the request"),
                                                "type": etype, "code": resp.status}}, status=resp.status)
        for name in [h for h in resp.headers if h.lower().startswith("x-pdxfer-")]:
            if not resp.prepared:
                del resp.headers[name]
        return resp

    return middleware
