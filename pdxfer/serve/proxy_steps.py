"""The two steps of one request through the proxy (proxy.py), prefill then decode, each retried
once on another instance while nothing reached the client.

The prefill step asks for one token, not streamed, one request per prompt of a completion of
several; the decode step's answer, streamed or not, goes to the client. A step that fails at an
instance raises StepFailed, which carries what the client gets if no retry answers; the proxy
decides what a failed prefill means (skip it, or the client's error).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from pdxfer.contracts.prefill_step import prefill_step_params
from pdxfer.serve.operator_view import OPERATOR_KEY, PROXY_ERROR_HEADER
from pdxfer.contracts.publish_hint import merge_hints
from pdxfer.serve.backends import Backend, BackendPool
from pdxfer.serve.http_headers import response_headers
from pdxfer.serve.proxy_metrics import ProxyMetrics
from pdxfer.serve.router import Route

log = logging.getLogger("pdxfer.proxy")

# Sampling fields that conflict with max_tokens=1 or would make the prefill step do extra work.
# Nothing that shapes the prompt may be dropped (messages, tools, chat_template_kwargs, ...):
# prefill and decode must see the same prompt tokens, or decode finds no chunks.
_PREFILL_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                 "best_of", "n", "echo", "stop", "stop_token_ids", "response_format",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")
NET_ERRORS = (aiohttp.ClientError, OSError)


def error_response(status: int, message: str, etype: str, backend: Backend | None = None,
                   headers: Mapping[str, str] | None = None) -> web.Response:
    """The proxy's own JSON error answer, naming the instance (and its role) when there is one."""
    body: dict[str, Any] = {"error": {"message": message, "type": etype, "code": status}}
    if backend is not None:
        body["error"]["instance"] = backend.url
        body["error"]["role"] = backend.role
    # Marked as the proxy's own: only the fleet's operator sees it as written (operator_view.py).
    return web.json_response(body, status=status, headers={**(headers or {}), PROXY_ERROR_HEADER: "1"})


def prefill_body(body: dict[str, Any], handoff: str) -> dict[str, Any]:
    """The request the prefill instance gets: same prompt, one token, no streaming, marked as a
    prefill step."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    if handoff == "nixl":
        p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}
    else:
        # A model with recurrent layers then computes all but the prompt's last token, whose
        # state the decode needs (pdxfer.contracts.prefill_step); other models ignore it.
        p["kv_transfer_params"] = prefill_step_params()
    return p


def split_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completion of several prompts (strings or token id lists), else None.
    A flat list of token ids is one prompt."""
    prompts = body.get("prompt")
    if (isinstance(prompts, list) and len(prompts) > 1
            and all(isinstance(p, (str, list)) for p in prompts)):
        return prompts
    return None


# Why a step failed at an instance (the ``reason`` label of the proxy's retry counter).
UNREACHABLE, TIMEOUT, HTTP_5XX, BAD_ANSWER, EMPTY_STREAM, CLIENT_ERROR = (
    "unreachable", "timeout", "http_5xx", "bad_answer", "empty_stream", "client_error")


class StepFailed(Exception):
    """One step failed at one instance. ``retry``: nothing reached the client and another
    instance may answer; ``status``: what the client gets if it is not retried (or the retry
    fails too); ``reason``: why, in a word (UNREACHABLE, ...); ``data``/``content_type``: an
    instance's own client-error answer, passed through."""

    def __init__(self, backend: Backend, status: int, message: str, retry: bool,
                 data: bytes | None = None, content_type: str = "application/json",
                 reason: str = HTTP_5XX) -> None:
        super().__init__(message)
        self.backend = backend
        self.status = status
        self.retry = retry
        self.data = data
        self.content_type = content_type
        self.reason = reason

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        if self.data is not None:  # the instance's own 4xx: the client's error, not ours
            return web.Response(body=self.data, status=self.status,
                                content_type=self.content_type, headers=headers)
        etype = "gateway_timeout" if self.status == 504 else "bad_gateway"
        return error_response(self.status, str(self), etype, self.backend, headers)


class Steps:
    """Sends the steps of a request to the pools' instances and counts them in the metrics.

    ``session``: the proxy's client session (it exists only once the proxy started);
    ``unreachable``: called for an instance a step could not reach (the proxy takes it out).
    """

    def __init__(self, prefill: BackendPool, decode: BackendPool, metrics: ProxyMetrics,
                 session: Callable[[], aiohttp.ClientSession],
                 unreachable: Callable[[Backend, BaseException], None], timeout: float,
                 connect_timeout: float, handoff: str) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics
        self._session = session
        self._unreachable = unreachable
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.handoff = handoff

    def _failed(self, b: Backend, e: BaseException, what: str) -> StepFailed:
        """A StepFailed for a network error or timeout of ``what`` at ``b``."""
        self.metrics.failures.labels(b.role).inc()
        if isinstance(e, asyncio.TimeoutError):
            b.errors += 1
            return StepFailed(b, 504, f"{b.role} instance {b.url} timed out ({what})", retry=False,
                              reason=TIMEOUT)
        self._unreachable(b, e)
        return StepFailed(b, 502, f"{b.role} instance {b.url} unreachable ({what}): "
                          f"{e.__class__.__name__}: {e}", retry=True, reason=UNREACHABLE)

    # --- the prefill step --------------------------------------------------------------------

    async def _post_prefill(self, b: Backend, path: str, body: dict[str, Any],
                            headers: CIMultiDict[str]) -> dict | None:
        """POST the prefill request to ``b``; its kv_transfer_params (None: none)."""
        b.in_flight += 1
        b.requests += 1
        t0 = time.monotonic()
        try:
            async with self._session().post(
                b.url + path, json=prefill_body(body, self.handoff), headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout),
            ) as r:
                data = await r.read()
                if r.status != 200:
                    if r.status < 500:
                        raise StepFailed(b, r.status, f"HTTP {r.status}", retry=False, data=data,
                                         content_type=r.content_type, reason=CLIENT_ERROR)
                    b.errors += 1
                    self.metrics.failures.labels(b.role).inc()
                    raise StepFailed(b, 502, f"prefill instance {b.url} answered HTTP {r.status}: "
                                     f"{data[:300].decode('utf-8', 'replace')}", retry=True)
                try:
                    return json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    if self.handoff != "nixl":
                        return None  # pdxfer's hint only shortens a wait: go on without it
                    raise StepFailed(b, 502, f"prefill instance {b.url} sent a non-JSON answer",
                                     retry=True, reason=BAD_ANSWER) from None
        except (asyncio.TimeoutError, *NET_ERRORS) as e:
            raise self._failed(b, e, "prefill") from e
        finally:
            b.in_flight -= 1
            self.metrics.step_took(b, time.monotonic() - t0)

    async def _prefill_one(self, first: Backend, path: str, body: dict[str, Any],
                           headers: CIMultiDict[str]) -> tuple[Backend, dict | None]:
        """The prefill of one prompt on ``first``, retried once on another healthy instance."""
        try:
            return first, await self._post_prefill(first, path, body, headers)
        except StepFailed as e:
            other = self.prefill_pool.pick(exclude=[first]) if e.retry else None
            if other is None:
                raise
            self.metrics.retries.labels("prefill", e.reason).inc()
            log.warning("%s; retrying the prefill on %s", e, other.url)
            return other, await self._post_prefill(other, path, body, headers)

    async def prefill(self, first: Backend, path: str, body: dict[str, Any],
                      headers: CIMultiDict[str]) -> tuple[Backend, dict | None]:
        """The prefill step. Several prompts: one prefill request per prompt, concurrently (an
        answer's hint is its own prompt's), and the decode gets all their hints."""
        prompts = split_prompts(body) if self.handoff == "none" else None
        if prompts is None:
            return await self._prefill_one(first, path, body, headers)
        done = await asyncio.gather(*(self._prefill_one(first, path, {**body, "prompt": p}, headers)
                                      for p in prompts))
        merged = merge_hints(params for _, params in done)
        return done[0][0], merged if merged is not None else done[0][1]

    # --- the decode step ---------------------------------------------------------------------

    def _route_headers(self, request: web.Request, route: Route, prefill_ms: float) -> dict[str, str]:
        if not request.get(OPERATOR_KEY, True):  # they name instances: the operator's only
            return {}
        h = {"x-pdxfer-route": route.route_header(), "x-pdxfer-route-reason": route.reason_header(),
             "X-Pdxfer-Decode": route.decode.url, "X-Pdxfer-Prefill-Ms": f"{prefill_ms:.2f}"}
        if route.prefill is not None:
            h["X-Pdxfer-Prefill"] = route.prefill.url
        return h

    async def decode(self, request: web.Request, route: Route, path: str, body: dict[str, Any],
                     headers: CIMultiDict[str], prefill_ms: float) -> web.StreamResponse:
        """The decode step on the route's instance, retried once elsewhere while nothing reached
        the client."""
        backend = route.decode
        for attempt in range(2):
            try:
                return await self._forward_decode(request, backend, path, body, headers,
                                                  self._route_headers(request, route, prefill_ms))
            except StepFailed as e:
                other = (self.decode_pool.pick(exclude=[backend]) if e.retry and attempt == 0
                         else None)
                if other is None:
                    if attempt:
                        e = StepFailed(e.backend, e.status, f"{e} (after a retry: the first "
                                       f"decode instance failed too)", e.retry, e.data,
                                       e.content_type, e.reason)
                    return e.response(self._route_headers(request, route, prefill_ms))
                self.metrics.retries.labels("decode", e.reason).inc()
                log.warning("%s; retrying the decode on %s", e, other.url)
                route.decode = backend = other
        raise AssertionError("unreachable")

    async def _forward_decode(self, request: web.Request, backend: Backend, path: str,
                              body: dict[str, Any], headers: CIMultiDict[str],
                              route_headers: dict[str, str]) -> web.StreamResponse:
        """Raises StepFailed only while nothing was sent to the client."""
        streaming = bool(body.get("stream"))
        # Non-streaming: one total bound. Streaming: bound the gap between chunks instead, so a
        # long generation is not cut while a stalled instance still is.
        timeout = (aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                         sock_read=self.timeout) if streaming else
                   aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout))
        backend.in_flight += 1
        backend.requests += 1
        t0 = time.monotonic()
        try:
            try:
                r = await self._session().post(backend.url + path, json=body, headers=headers,
                                               timeout=timeout)
            except (asyncio.TimeoutError, *NET_ERRORS) as e:
                raise self._failed(backend, e, "decode") from e
            async with r:
                out_headers = response_headers(r.headers)
                out_headers.update(route_headers)
                try:
                    first = await (r.read() if not streaming or r.status != 200
                                   else r.content.readany())
                except (asyncio.TimeoutError, *NET_ERRORS) as e:
                    raise self._failed(backend, e, "decode, before its first byte") from e
                if not streaming or r.status != 200:
                    if r.status >= 500:
                        backend.errors += 1
                        self.metrics.failures.labels(backend.role).inc()
                        raise StepFailed(backend, 502, f"decode instance {backend.url} answered "
                                         f"HTTP {r.status}: {first[:300].decode('utf-8', 'replace')}",
                                         retry=True)
                    return web.Response(body=first, status=r.status, content_type=r.content_type,
                                        headers=out_headers)
                if not first:  # the instance closed the stream before sending anything
                    self.metrics.failures.labels(backend.role).inc()
                    raise StepFailed(backend, 502, f"decode instance {backend.url} closed its "
                                     "stream before sending anything", retry=True, reason=EMPTY_STREAM)
                resp = web.StreamResponse(status=200, headers=out_headers)
                resp.content_type = r.content_type or "text/event-stream"
                await resp.prepare(request)
                await resp.write(first)
                try:
                    async for chunk in r.content.iter_any():
                        await resp.write(chunk)
                except (asyncio.TimeoutError, *NET_ERRORS) as e:
                    # Headers are gone already: tell the client in-band, as an SSE error event.
                    backend.errors += 1
                    self.metrics.failures.labels(backend.role).inc()
                    self.metrics.streams_cut.labels(backend.role).inc()
                    log.warning("decode instance %s failed mid-stream (%s: %s): the client got an error "
                                "event and the end of the stream", backend.url, e.__class__.__name__, e)
                    msg = {"error": {"message": f"decode instance {backend.url} failed mid-stream: "
                                     f"{e.__class__.__name__}: {e}", "type": "bad_gateway",
                                     "code": 502, "instance": backend.url}}
                    try:
                        await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
                    except (ConnectionError, RuntimeError):
                        pass
                await resp.write_eof()
                return resp
        finally:
            backend.in_flight -= 1
            self.metrics.step_took(backend, time.monotonic() - t0)
