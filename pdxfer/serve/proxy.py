"""The PD proxy: one OpenAI-compatible endpoint in front of a fleet of prefill and decode vLLM
instances.

For each `/v1/completions` or `/v1/chat/completions` request it
1. asks the router (router.py) where to go: which prefill instance, or none, and which decode,
   from what the master's index says the fleet holds of the prompt (when a master is given);
2. sends the request to the prefill instance with `max_tokens=1` and `stream: false` (the prefill
   computes the prompt's KV; its connector publishes the full chunks to the master),
3. then sends the original request to the decode instance, whose connector finds those chunks
   through the master and reads them; the decode answer (streamed or not) goes to the client.

The client's headers (Authorization, X-Request-Id, ...; not the hop-by-hop ones) go to both steps.
The route and its reason are in the response headers ``x-pdxfer-route`` (``prefill=<url>
decode=<url>`` or ``decode-only=<url>``) and ``x-pdxfer-route-reason``, in the log and in
``/metrics``.

No block ids travel through the proxy (pdxfer's decode finds chunks by content hash). A prefill
answer's `kv_transfer_params` go into the decode request: pdxfer's publish hint (the decode waits,
bounded, for chunks whose publish is still on its way). vLLM answers a completion of several
prompts with prompt 0's `kv_transfer_params` only, so such a completion is prefilled one prompt
per request and the decode request carries every prompt's hint (each names its prompt; each
decode prompt uses only its own). For vLLM's own NixlConnector, `handoff="nixl"` also asks
prefill for `kv_transfer_params`, which carry its block ids.

Failures: an instance that fails its health check or cannot be reached is taken out until its
health check passes again (backends.py). A step whose instance fails before anything reached the
client is retried once on another healthy instance (the steps: proxy_steps.py). A prefill step that still fails is skipped:
the decode computes the prompt itself (reason ``prefill-failed``; with
``prefill_failure="error"`` the client gets the error instead). A decode step that still fails
gives a JSON error naming the instance (502; 504 for a timeout, which is not retried: the
instance may still be working on it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pdxfer.common.cli_common import LOG_FORMAT
from pdxfer.common.secret_file import read_secret_file

from pdxfer.serve.backends import Backend, BackendPool, HealthChecker, load_backends_file
from pdxfer.serve.discovery import Discovery, split_specs
from pdxfer.serve.drain import DrainEndpoint
from pdxfer.serve.operator_view import PROXY_ERROR_HEADER, OperatorGate, operator_middleware
from pdxfer.serve.http_headers import request_headers
from pdxfer.serve.index_view import IndexView
from pdxfer.serve.load_costs import LoadCostScraper
from pdxfer.serve.proxy_metrics import ProxyMetrics
from pdxfer.serve.proxy_steps import NET_ERRORS, StepFailed, Steps, error_response
from pdxfer.serve.router import NoHealthyInstance, RouteConfig, Router

log = logging.getLogger("pdxfer.proxy")

HANDOFFS = ("none", "nixl")
PREFILL_FAILURE = ("error", "decode")


class PDProxy:
    """The aiohttp application and its state; `app` is ready to be served."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], policy: str = "least_loaded",
                 timeout: float = 300, connect_timeout: float = 5, handoff: str = "none",
                 prefill_failure: str = "decode", master: str | None = None,
                 master_token: str | None = None, route: RouteConfig | None = None,
                 health_interval: float = 2.0, health_timeout: float = 2.0,
                 discovery_interval: float = 5.0, discovery_timeout: float = 2.0,
                 load_cost_interval: float = 5.0) -> None:
        """``prefill``/``decode``: instance URLs, or ``dns+http://NAME:PORT`` for every address
        NAME resolves to, resolved again every ``discovery_interval`` seconds (discovery.py).
        ``load_cost_interval``: seconds between reads of each decode instance's measured load
        costs from its /metrics (load_costs.py; 0: never, every held token counts)."""
        if handoff not in HANDOFFS:
            raise ValueError(f"unknown handoff {handoff!r}; known: {', '.join(HANDOFFS)}")
        if prefill_failure not in PREFILL_FAILURE:
            raise ValueError(f"unknown prefill_failure {prefill_failure!r}; known: "
                             f"{', '.join(PREFILL_FAILURE)}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if load_cost_interval < 0:
            raise ValueError(f"load_cost_interval must not be negative, got {load_cost_interval}")
        p_urls, p_dns = split_specs("prefill", prefill)
        d_urls, d_dns = split_specs("decode", decode)
        self.prefill = BackendPool.from_urls("prefill", p_urls, policy, allow_empty=bool(p_dns))
        self.decode = BackendPool.from_urls("decode", d_urls, policy, allow_empty=bool(d_dns))
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.handoff = handoff
        self.prefill_failure = prefill_failure
        route = route or RouteConfig()
        # NixlConnector moves block ids from a prefill it ran: a decode-only route has none.
        self.index = (IndexView(master, master_token, timeout_s=route.index_timeout_s)
                      if master and handoff == "none" else None)
        # Only the index's routing weighs tiers: without it, nothing to read costs for.
        self.load_costs = (LoadCostScraper(self.decode, load_cost_interval, health_timeout,
                                           keep_s=max(60.0, 6 * load_cost_interval))
                           if self.index is not None and load_cost_interval > 0 else None)
        self.router = Router(self.prefill, self.decode, self.index, route, self.load_costs)
        self.metrics = ProxyMetrics()
        self.metrics.recent_blocks.set_function(self.router.recent.total_blocks)
        for b in self.prefill.backends + self.decode.backends:
            self.metrics.healthy.labels(b.role, b.url).set(1)
        self.steps = Steps(self.prefill, self.decode, self.metrics, lambda: self.session,
                           self._unreachable, timeout, connect_timeout, handoff)
        self.health = HealthChecker((self.prefill, self.decode), health_interval, health_timeout,
                                    self._backend_changed)
        self.discovery = (Discovery((self.prefill, self.decode), p_dns + d_dns, discovery_interval,
                                    discovery_timeout, self.metrics.backend_added,
                                    self._backend_removed)
                          if p_dns or d_dns else None)
        self._session: aiohttp.ClientSession | None = None
        gate = OperatorGate(master_token)
        self.app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[operator_middleware(gate)])
        DrainEndpoint((self.prefill, self.decode)).add_routes(self.app)
        self.app.router.add_get("/health", self.health_endpoint)
        self.app.router.add_get("/metrics", self.metrics_endpoint)
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
        if self.discovery is not None:
            # Once before serving (bounded by the discovery timeout): the first requests find
            # the instances that are there already.
            await self.discovery.refresh()
            self.discovery.start()
        self.health.start(self._session)
        if self.load_costs is not None:
            self.load_costs.start(self._session)

    async def _cleanup(self, app: web.Application) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        if self.load_costs is not None:
            await self.load_costs.stop()
        if self._session is not None:
            await self._session.close()
        if self.index is not None:
            await asyncio.to_thread(self.index.close)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "proxy not started"
        return self._session

    def _unreachable(self, b: Backend, e: BaseException) -> None:
        """A request could not reach ``b``: out until its health check passes."""
        b.errors += 1
        if b.mark_down(f"unreachable: {e.__class__.__name__}: {e}"):
            log.warning("%s instance %s taken out: %s", b.role, b.url, b.down_reason)
            self._backend_changed(b, False)

    def _backend_changed(self, b: Backend, healthy: bool) -> None:
        self.metrics.backend_changed(b, healthy)
        if not healthy:
            self.router.forget(b)

    def _backend_removed(self, b: Backend) -> None:
        self.metrics.backend_removed(b)
        self.router.forget(b)
        if self.load_costs is not None:
            self.load_costs.forget(b.url)

    @staticmethod
    def _no_healthy(pool: BackendPool) -> web.Response:
        body = {"error": {"message": f"no healthy {pool.role} instance ({pool.describe_down()})",
                          "type": "service_unavailable", "code": 503, "role": pool.role,
                          "instances": [b.url for b in pool.backends]}}
        return web.json_response(body, status=503, headers={PROXY_ERROR_HEADER: "1"})

    # --- plain endpoints ---------------------------------------------------------------------

    async def health_endpoint(self, request: web.Request) -> web.Response:
        """200 while a decode instance is in (the proxy can answer); with ``?require=all``
        (readiness, e.g. for `pdxfer launch`) only while every instance of both roles is."""
        ok = bool(self.decode.healthy())
        status = "ok" if ok else "no healthy decode instance"
        require = request.query.get("require")
        if require not in (None, "all"):
            return web.json_response({"error": {"message": f"require={require!r}: only 'all' is known",
                                                "type": "invalid_request_error", "code": 400}}, status=400)
        if ok and require == "all":
            out = [f"{pool.role} {pool.describe_down()}" for pool in (self.prefill, self.decode)
                   if len(pool.healthy()) < len(pool.backends)]
            if out:
                ok, status = False, "instances out: " + "; ".join(out)
        doc: dict[str, Any] = {
            "status": status,
            "prefill": [b.as_dict() for b in self.prefill.backends],
            "decode": [self._decode_dict(b) for b in self.decode.backends],
        }
        if self.discovery is not None:
            doc["dns"] = self.discovery.describe()
        return web.json_response(doc, status=200 if ok else 503)

    def _decode_dict(self, b: Backend) -> dict[str, Any]:
        """A decode instance in /health, with the load costs the router weighs tiers by."""
        costs = self.load_costs.get(b.url) if self.load_costs is not None else None
        return {**b.as_dict(), **({"load_costs": costs.as_dict()} if costs is not None else {})}

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        backend = self.decode.pick() or self.decode.pick(last_resort=True)
        if backend is None:
            return self._no_healthy(self.decode)
        try:
            async with self.session.get(backend.url + "/v1/models",
                                        headers=request_headers(request.headers),
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type)
        except asyncio.TimeoutError:
            backend.errors += 1
            return error_response(504, f"decode instance {backend.url} timed out",
                                  "gateway_timeout", backend)
        except NET_ERRORS as e:
            self._unreachable(backend, e)
            return error_response(502, f"decode instance {backend.url} unreachable: "
                                  f"{e.__class__.__name__}: {e}", "bad_gateway", backend)

    # --- the P/D flow ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error_response(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object",
                                  "invalid_request_error")
        # The hand-off between the steps is the proxy's: a client's own kv_transfer_params could
        # name another request's blocks (NixlConnector) or hold a decode in a hint wait (pdxfer).
        if body.pop("kv_transfer_params", None) is not None:
            self.metrics.client_kv_params_dropped.inc()
        path = request.path
        headers = request_headers(request.headers)
        try:
            route = await self.router.route(self.session, path, body, headers)
        except NoHealthyInstance as e:
            return self._no_healthy(e.pool)
        if route.reason == "no-prefill" and self.prefill_failure == "error":
            return self._no_healthy(self.prefill)
        t0 = time.perf_counter()
        kv_params: dict | None = None
        if route.prefill is not None:
            try:
                route.prefill, kv_params = await self.steps.prefill(route.prefill, path, body,
                                                                     headers)
            except StepFailed as e:
                if e.data is not None or self.prefill_failure == "error":
                    # Client errors (bad prompt, too long) are the client's: pass them through.
                    return e.response()
                log.warning("%s; decode computes the prompt", e)
                route.prefill, route.reason, route.detail = None, "prefill-failed", str(e)
        prefill_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.routes.labels(route.decision, route.reason, route.decode_reason).inc()
        log.info("route %s %s; %s", path, route.route_header(), route.reason_header())

        decode_req = dict(body)
        if kv_params is not None:
            decode_req["kv_transfer_params"] = kv_params
        return await self.steps.decode(request, route, path, decode_req, headers, prefill_ms)


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
    dns = ([s.spec for s in proxy.discovery.sources] if proxy.discovery is not None else [])
    print(f"pdxfer proxy on http://{host}:{bound}  prefill={[b.url for b in proxy.prefill.backends]}"
          f" decode={[b.url for b in proxy.decode.backends]}" + (f" dns={dns}" if dns else ""),
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def _read_token(path: Path | None) -> str | None:
    # A SecretFileError is a ValueError: the caller turns it into the CLI's exit message.
    return read_secret_file(path, "--master-token-file") if path is not None else None


def run_proxy_cli(args: argparse.Namespace) -> int:
    """`pdxfer proxy`: serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format=LOG_FORMAT, force=True)
    try:
        prefill, decode = list(args.prefill or []), list(args.decode or [])
        if args.backends is not None:
            more_p, more_d = load_backends_file(args.backends)
            prefill, decode = prefill + more_p, decode + more_d
        route = RouteConfig(skip_prefill_tokens=args.skip_prefill_tokens,
                            skip_prefill_fraction=args.skip_prefill_fraction,
                            index_timeout_s=args.index_timeout,
                            holder_max_extra_load=args.holder_max_extra_load,
                            recent_prompt_tokens=args.recent_prompt_tokens)
        proxy = PDProxy(prefill, decode, policy=args.policy, timeout=args.timeout,
                        connect_timeout=args.connect_timeout, handoff=args.handoff,
                        prefill_failure=args.prefill_failure, master=args.master,
                        master_token=_read_token(args.master_token_file), route=route,
                        health_interval=args.health_interval, health_timeout=args.health_timeout,
                        discovery_interval=args.discovery_interval,
                        discovery_timeout=args.discovery_timeout,
                        load_cost_interval=args.load_cost_interval)
    except ValueError as e:
        raise SystemExit(f"pdxfer proxy: {e}") from e
    asyncio.run(_serve_forever(proxy, args.host, args.port, args.port_file))
    return 0
