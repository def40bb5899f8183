"""The PD proxy: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

For each `/v1/completions` or `/v1/chat/completions` request it
1. sends the request to a prefill instance with `max_tokens=1` and `stream: false` (the prefill
   computes the prompt's KV; its connector publishes the full chunks to the master),
2. then sends the original request to a decode instance, whose connector finds those chunks
   through the master and reads them; the decode answer (streamed or not) goes to the client.

No block ids travel through the proxy (pdxfer's decode finds chunks by content hash). A prefill
answer's `kv_transfer_params` go into the decode request: pdxfer's publish hint (the decode waits,
bounded, for chunks whose publish is still on its way). vLLM answers a completion of several
prompts with prompt 0's `kv_transfer_params` only, so such a completion is prefilled one prompt
per request and the decode request carries every prompt's hint (each names its prompt; each
decode prompt uses only its own). For vLLM's own NixlConnector,
`handoff="nixl"` also asks prefill for `kv_transfer_params`, which carry its block ids.

Instances are chosen round-robin or least-loaded (fewest requests in flight, ties in turn). An
instance that cannot be reached gives a 502 JSON error naming it; a timeout gives 504; with
`prefill_failure="decode"` a failed prefill step is skipped (decode computes the prompt itself).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
from aiohttp import web

from pdxfer.vllm.publish_hint import merge_hints

log = logging.getLogger("pdxfer.proxy")

POLICIES = ("round_robin", "least_loaded")
HANDOFFS = ("none", "nixl")
PREFILL_FAILURE = ("error", "decode")
# Sampling fields that conflict with max_tokens=1 or would make the prefill step do extra work.
# Nothing that shapes the prompt may be dropped (messages, tools, chat_template_kwargs, ...):
# prefill and decode must see the same prompt tokens, or decode finds no chunks.
_PREFILL_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                 "best_of", "n", "echo", "stop", "stop_token_ids", "response_format",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")


@dataclass
class Backend:
    url: str
    role: str
    in_flight: int = 0
    requests: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "in_flight": self.in_flight,
                "requests": self.requests, "errors": self.errors}


@dataclass
class BackendPool:
    """Instances of one role and the choice between them."""

    role: str
    backends: list[Backend]
    policy: str = "least_loaded"
    _turn: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def from_urls(cls, role: str, urls: Sequence[str], policy: str) -> "BackendPool":
        if not urls:
            raise ValueError(f"no {role} instance given")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"{role} instance URL must start with http:// or https://: {u!r}")
        return cls(role, [Backend(u.rstrip("/"), role) for u in urls], policy)

    def pick(self) -> Backend:
        n = len(self.backends)
        start = next(self._turn) % n
        order = self.backends[start:] + self.backends[:start]  # rotate so ties take turns
        if self.policy == "round_robin":
            return order[0]
        return min(order, key=lambda b: b.in_flight)


class UpstreamError(Exception):
    """A backend could not answer; carries the HTTP status the client gets."""

    def __init__(self, status: int, message: str, backend: Backend) -> None:
        super().__init__(message)
        self.status = status
        self.backend = backend


def _error_response(status: int, message: str, etype: str, backend: Backend | None = None
                    ) -> web.Response:
    body: dict[str, Any] = {"error": {"message": message, "type": etype, "code": status}}
    if backend is not None:
        body["error"]["instance"] = backend.url
        body["error"]["role"] = backend.role
    return web.json_response(body, status=status)


def prefill_body(body: dict[str, Any], handoff: str) -> dict[str, Any]:
    """The request the prefill instance gets: same prompt, one token, no streaming."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    if handoff == "nixl":
        p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}
    return p


def split_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completion of several prompts (strings or token id lists), else None.
    A flat list of token ids is one prompt."""
    prompts = body.get("prompt")
    if (isinstance(prompts, list) and len(prompts) > 1
            and all(isinstance(p, (str, list)) for p in prompts)):
        return prompts
    return None


class PDProxy:
    """The aiohttp application and its state; `app` is ready to be served."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], policy: str = "least_loaded",
                 timeout: float = 300, connect_timeout: float = 5, handoff: str = "none",
                 prefill_failure: str = "error") -> None:
        if handoff not in HANDOFFS:
            raise ValueError(f"unknown handoff {handoff!r}; known: {', '.join(HANDOFFS)}")
        if prefill_failure not in PREFILL_FAILURE:
            raise ValueError(f"unknown prefill_failure {prefill_failure!r}; known: "
                             f"{', '.join(PREFILL_FAILURE)}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.prefill = BackendPool.from_urls("prefill", prefill, policy)
        self.decode = BackendPool.from_urls("decode", decode, policy)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.handoff = handoff
        self.prefill_failure = prefill_failure
        self._session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    async def _startup(self, app: web.Application) -> None:
        # No pool limit: concurrency is bounded by the instances, not by the proxy.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                          sock_read=self.timeout),
        )

    async def _cleanup(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "proxy not started"
        return self._session

    # --- plain endpoints ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({
            "status": "ok",
            "prefill": [b.as_dict() for b in self.prefill.backends],
            "decode": [b.as_dict() for b in self.decode.backends],
        })

    async def models(self, request: web.Request) -> web.Response:
        backend = self.decode.pick()
        try:
            async with self.session.get(backend.url + "/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            backend.errors += 1
            return self._upstream_failure(e, backend)

    # --- the P/D flow ------------------------------------------------------------------------

    def _upstream_failure(self, e: BaseException, backend: Backend) -> web.Response:
        if isinstance(e, asyncio.TimeoutError):
            return _error_response(504, f"{backend.role} instance {backend.url} timed out",
                                   "gateway_timeout", backend)
        return _error_response(502, f"{backend.role} instance {backend.url} unreachable: "
                               f"{e.__class__.__name__}: {e}", "bad_gateway", backend)

    async def _run_prefill(self, path: str, body: dict[str, Any]) -> tuple[Backend, dict | None]:
        """POST the prefill request; returns (backend, kv_transfer_params or None)."""
        backend = self.prefill.pick()
        backend.in_flight += 1
        backend.requests += 1
        try:
            async with self.session.post(
                backend.url + path, json=prefill_body(body, self.handoff),
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout),
            ) as r:
                data = await r.read()
                if r.status != 200:
                    backend.errors += r.status >= 500
                    raise _BackendStatus(r.status, data, r.content_type, backend)
                try:
                    return backend, json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    if self.handoff != "nixl":
                        return backend, None  # pdxfer's hint only shortens a wait: go on without it
                    raise UpstreamError(502, f"prefill instance {backend.url} sent a non-JSON "
                                        "answer", backend) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            backend.errors += 1
            status = 504 if isinstance(e, asyncio.TimeoutError) else 502
            what = "timed out" if status == 504 else f"unreachable: {e.__class__.__name__}: {e}"
            raise UpstreamError(status, f"prefill instance {backend.url} {what}", backend) from e
        finally:
            backend.in_flight -= 1

    async def _prefill(self, path: str, body: dict[str, Any]) -> tuple[Backend, dict | None]:
        """The prefill step. Several prompts: one prefill request per prompt, concurrently (an
        answer's hint is its own prompt's), and the decode gets all their hints."""
        prompts = split_prompts(body) if self.handoff == "none" else None
        if prompts is None:
            return await self._run_prefill(path, body)
        done = await asyncio.gather(*(self._run_prefill(path, {**body, "prompt": p}) for p in prompts))
        merged = merge_hints(params for _, params in done)
        return done[0][0], merged if merged is not None else done[0][1]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error_response(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error_response(400, "request body must be a JSON object",
                                   "invalid_request_error")
        path = request.path
        t0 = time.perf_counter()
        prefill_backend: Backend | None = None
        kv_params: dict | None = None
        try:
            prefill_backend, kv_params = await self._prefill(path, body)
        except _BackendStatus as e:
            if e.status < 500 or self.prefill_failure == "error":
                # Client errors (bad prompt, too long) are the client's: pass them through.
                if e.status < 500:
                    return web.Response(body=e.data, status=e.status, content_type=e.content_type)
                return _error_response(502, f"prefill instance {e.backend.url} answered HTTP "
                                       f"{e.status}: {e.data[:300].decode('utf-8', 'replace')}",
                                       "bad_gateway", e.backend)
            log.warning("prefill failed (HTTP %d at %s); decode computes the prompt",
                        e.status, e.backend.url)
        except UpstreamError as e:
            if self.prefill_failure == "error":
                return _error_response(e.status, str(e), "bad_gateway" if e.status == 502
                                       else "gateway_timeout", e.backend)
            log.warning("%s; decode computes the prompt", e)
        prefill_ms = (time.perf_counter() - t0) * 1000.0

        decode_req = dict(body)
        if kv_params is not None:
            decode_req["kv_transfer_params"] = kv_params
        backend = self.decode.pick()
        backend.in_flight += 1
        backend.requests += 1
        headers = {"X-Pdxfer-Decode": backend.url, "X-Pdxfer-Prefill-Ms": f"{prefill_ms:.2f}"}
        if prefill_backend is not None:
            headers["X-Pdxfer-Prefill"] = prefill_backend.url
        try:
            return await self._forward_decode(request, backend, path, decode_req, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            backend.errors += 1
            return self._upstream_failure(e, backend)
        finally:
            backend.in_flight -= 1

    async def _forward_decode(self, request: web.Request, backend: Backend, path: str,
                              body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        streaming = bool(body.get("stream"))
        # Non-streaming: one total bound. Streaming: bound the gap between chunks instead, so a
        # long generation is not cut while a stalled instance still is.
        timeout = (aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                         sock_read=self.timeout) if streaming else
                   aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout))
        async with self.session.post(backend.url + path, json=body, timeout=timeout) as r:
            if not streaming or r.status != 200:
                data = await r.read()
                if r.status >= 500:
                    backend.errors += 1
                    return _error_response(502, f"decode instance {backend.url} answered HTTP "
                                           f"{r.status}: {data[:300].decode('utf-8', 'replace')}",
                                           "bad_gateway", backend)
                return web.Response(body=data, status=r.status, content_type=r.content_type,
                                    headers=headers)
            resp = web.StreamResponse(status=200, headers=headers)
            resp.content_type = r.content_type or "text/event-stream"
            await resp.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                # Headers are gone already: tell the client in-band, as an SSE error event.
                backend.errors += 1
                msg = {"error": {"message": f"decode instance {backend.url} failed mid-stream: "
                                 f"{e.__class__.__name__}: {e}", "type": "bad_gateway",
                                 "code": 502, "instance": backend.url}}
                try:
                    await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
                except (ConnectionError, RuntimeError):
                    pass
            await resp.write_eof()
            return resp


class _BackendStatus(Exception):
    def __init__(self, status: int, data: bytes, content_type: str, backend: Backend) -> None:
        super().__init__(f"HTTP {status} from {backend.url}")
        self.status = status
        self.data = data
        self.content_type = content_type
        self.backend = backend


# ---------------------------------------------------------------------------------------------
# Serving
# ---------------------------------------------------------------------------------------------


class RunningProxy:
    """A proxy served on its own event loop in a background thread (tests, benchmarks)."""

    def __init__(self, proxy: PDProxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.proxy = proxy
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(proxy.app, access_log=None)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), daemon=True,
                                        name="pdxfer-proxy")
        self._thread.start()
        if not self._started.wait(30):
            raise TimeoutError("proxy did not start within 30 s")
        if self._error is not None:
            raise self._error
        self.url = f"http://{host}:{self.port}"

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)

    def __enter__(self) -> "RunningProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _serve_forever(proxy: PDProxy, host: str, port: int, port_file: Path | None) -> None:
    runner = web.AppRunner(proxy.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if port_file is not None:
        tmp = port_file.with_suffix(port_file.suffix + ".tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(port_file)
    print(f"pdxfer proxy on http://{host}:{bound}  prefill={[b.url for b in proxy.prefill.backends]}"
          f" decode={[b.url for b in proxy.decode.backends]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run_proxy_cli(args: argparse.Namespace) -> int:
    """`pdxfer proxy`: serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = PDProxy(args.prefill, args.decode, policy=args.policy, timeout=args.timeout,
                        connect_timeout=args.connect_timeout, handoff=args.handoff,
                        prefill_failure=args.prefill_failure)
    except ValueError as e:
        raise SystemExit(f"pdxfer proxy: {e}") from e
    asyncio.run(_serve_forever(proxy, args.host, args.port, args.port_file))
    return 0
