"""Stand-ins for vLLM instances behind the proxy: real aiohttp servers on real sockets, with the
endpoints the proxy uses (/health, /metrics, /tokenize, /v1/completions, /v1/chat/completions).

In-process (:class:`StandIn`, served from a thread, its state readable by the test) or as a child
process (``python -m tests.serve.stand_ins``) that a test can SIGKILL.

Their tokenizer: one token per UTF-8 byte of the prompt (a chat: of its messages' contents joined
by newlines), so a test knows every prompt's token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]


def stand_in_tokens(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return list("\n".join(str(m.get("content", "")) for m in body["messages"]).encode())
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else list(str(prompt).encode())


def load_cost_page(host: float = 0.0, device: float = 0.0, compute: float = 0.0, engines: int = 1) -> str:
    """What a decode's /metrics shows of its load gate's costs (seconds per prompt token; 0: not
    measured), rendered by prometheus_client as vLLM renders it, amid metrics of vLLM's own."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from pdxfer.contracts.connector_metric_defs import COMPUTE_COST, LABELS, LOAD_COST

    reg = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens", LABELS, registry=reg).labels("tiny", "0").inc(5)
    load = Gauge(LOAD_COST.name, LOAD_COST.help, LOAD_COST.labels, registry=reg)
    comp = Gauge(COMPUTE_COST.name, COMPUTE_COST.help, COMPUTE_COST.labels, registry=reg)
    for e in range(engines):
        load.labels("tiny", str(e), "host").set(host)
        load.labels("tiny", str(e), "device").set(device)
        comp.labels("tiny", str(e)).set(compute)
    return generate_latest(reg).decode()


class StandInApp:
    """The endpoints and what they saw. ``delay``: seconds before a completion answers (before
    its first byte); ``gate``: a streamed answer waits for it between its first and second event;
    ``metrics_text``/``metrics_status``/``metrics_delay``: what GET /metrics answers (a vLLM
    instance's page), and after how long."""

    def __init__(self, name: str, delay: float = 0.0, gap: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.gap = gap  # seconds between two streamed events
        self.healthy = True
        self.gate: threading.Event | None = None
        self.received: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.health_checks = 0
        self.metrics_text = ""
        self.metrics_status = 200
        self.metrics_delay = 0.0
        self.metrics_scrapes = 0
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_post("/v1/completions", self._complete)
        self.app.router.add_post("/v1/chat/completions", self._complete)

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        if self.metrics_delay:
            await asyncio.sleep(self.metrics_delay)
        return web.Response(status=self.metrics_status, text=self.metrics_text,
                            content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        tokens = stand_in_tokens(body)
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body, dict(request.headers)))
        if self.delay:
            await asyncio.sleep(self.delay)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Answered-By": self.name})
            await resp.prepare(request)
            for i in range(4):
                await resp.write(f"data: {json.dumps({'i': i, 'by': self.name})}\n\n".encode())
                if i == 0 and self.gate is not None:
                    gate = self.gate
                    await asyncio.get_running_loop().run_in_executor(None, gate.wait, 15)
                if self.gap:
                    await asyncio.sleep(self.gap)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"by": self.name, "choices": [{"text": f"from {self.name}"}],
                                  "usage": {"prompt_tokens": len(stand_in_tokens(body))}},
                                 headers={"X-Answered-By": self.name})


class ThreadServer:
    """An aiohttp app served on 127.0.0.1 (a free port) from a background thread of the test process."""

    def __init__(self, app: web.Application, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()
        assert ready.wait(10), f"{name} did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class StandIn(StandInApp):
    """Served from a background thread of the test process."""

    def __init__(self, name: str, delay: float = 0.0, gap: float = 0.0) -> None:
        super().__init__(name, delay, gap)
        self._server = ThreadServer(self.app, f"stand-in-{name}")
        self.port, self.url = self._server.port, self._server.url

    def stop(self) -> None:
        self._server.stop()


class StandInProcess:
    """A stand-in in a child process (to be killed); it answers like :class:`StandInApp`."""

    def __init__(self, name: str, workdir: Path, delay: float = 0.0, gap: float = 0.0) -> None:
        self.name = name
        port_file = workdir / f"{name}-{time.monotonic_ns()}.port"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.serve.stand_ins", "--name", name, "--delay", str(delay),
             "--gap", str(gap), "--port-file", str(port_file)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"stand-in {name} did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no goodbye on its sockets beyond what the kernel sends
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--gap", type=float, default=0.0)
    ap.add_argument("--port-file", type=Path, required=True)
    args = ap.parse_args()
    stand_in = StandInApp(args.name, args.delay, args.gap)

    async def serve() -> None:
        runner = web.AppRunner(stand_in.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    _main()
