"""The pdxfer-master process: command line, signals, port file (``pdxfer-master``, or
``python -m pdxfer.master.service``). The flags are described in ``pdxfer/master/__init__.py``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from pdxfer.master import etcd_layout
from pdxfer.master.coordinator import coordinator_for
from pdxfer.master.service import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_LOCK_TTL_S,
    MasterService,
)

log = logging.getLogger("pdxfer.master")


def _write_port_file(path: str, port: int, http_port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n{http_port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdxfer-master", description="pdxfer chunk index service")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on for the wire protocol")
    p.add_argument("--port", type=int, default=0, help="wire protocol port (0: chosen by the OS)")
    p.add_argument("--port-file", help="write '<port>\\n<http port>\\n' here once listening")
    p.add_argument("--http-host", help="address for /metrics and /health (default: --host)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (0: chosen by the OS, -1: off)")
    p.add_argument("--advertise", help="host:port published as leader address in etcd (default host:port)")
    p.add_argument("--token-file", help="shared secret every request must carry")
    p.add_argument("--etcd", help="host:port[,host:port] of etcd: HA mode (default: standalone, in memory)")
    p.add_argument("--etcd-prefix", default="/pdxfer/master", help="key prefix in etcd")
    p.add_argument("--leader-ttl", type=float, default=5.0, help="leader lease TTL in seconds (etcd mode)")
    p.add_argument("--etcd-timeout", type=float, default=1.0, help="per-call etcd timeout in seconds")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (for hit_tokens only)")
    p.add_argument("--max-entries", type=int, default=10_000_000, help="refuse publishes beyond this")
    p.add_argument("--max-lock-ttl", type=float, default=DEFAULT_MAX_LOCK_TTL_S,
                   help="cap on reader lock TTLs in seconds, announced to holders at registration")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="concurrent client connections; more are refused (and logged)")
    p.add_argument("--handshake-timeout", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT_S,
                   help="seconds a new connection has to send its first frame (hello)")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help="seconds an authenticated connection may stay idle")
    p.add_argument("--log-level", default="INFO")
    return p


def _read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"pdxfer-master: cannot read token file {path}: {exc}") from None
    if not token:
        raise SystemExit(f"pdxfer-master: token file {path} is empty")
    return token


async def _amain(args: argparse.Namespace) -> None:
    if args.etcd and not args.advertise and args.host in ("0.0.0.0", "::", ""):
        raise SystemExit("pdxfer-master: listening on a wildcard address; give --advertise HOST:PORT so "
                         "clients that find the leader in etcd can reach it")
    url = etcd_layout.etcd_url(args.etcd, args.etcd_prefix) if args.etcd else None
    try:
        coordinator = coordinator_for(url, args.leader_ttl, args.etcd_timeout)
    except ImportError as exc:
        raise SystemExit(f"pdxfer-master: --etcd needs the aetcd package ({exc})") from None
    except ValueError as exc:
        raise SystemExit(f"pdxfer-master: --etcd {args.etcd!r}: {exc}") from None
    try:
        svc = MasterService(
            token=_read_token(args.token_file) if args.token_file else None,
            coordinator=coordinator,
            chunk_tokens=args.chunk_tokens,
            max_entries=args.max_entries,
            max_lock_ttl_s=args.max_lock_ttl,
            max_connections=args.max_connections,
            handshake_timeout_s=args.handshake_timeout,
            idle_timeout_s=args.idle_timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"pdxfer-master: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await svc.start(args.host, args.port, args.http_host, args.http_port, args.advertise)
    if args.port_file:
        _write_port_file(args.port_file, svc.port, svc.http_port)
    log.info("pdxfer-master listening on %s:%d (http %d, store %s)", args.host, svc.port, svc.http_port,
             svc.coord.kind)
    await stop.wait()
    log.info("shutting down")
    await svc.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(_amain(args))
