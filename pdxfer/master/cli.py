"""The pdxfer-master process: command line, signals, port file (``pdxfer-master``, or
``python -m pdxfer.master.service``). The flags are described in ``pdxfer/master/__init__.py``."""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import logging
import os
import signal
import sys
from typing import Mapping

import uvloop

from pdxfer.common.cli_common import EXIT_INTERRUPTED, EXIT_OK, LOG_FORMAT, HelpFormatter, add_log_level
from pdxfer.master.backends import etcd_layout, etcd_security
from pdxfer.master.wire import tls as master_tls
from pdxfer.master.backends.choice import coordinator_for
from pdxfer.common.ports import PortRange, PortSpecError, parse_port_spec
from pdxfer.common.secret_file import SecretFileError, read_secret_file
from pdxfer.master.server.conn_slots import DEFAULT_MAX_UNPROVEN_PER_PEER
from pdxfer.master.server.master_service import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_LOCK_TTL_S,
    MasterService,
)

log = logging.getLogger("pdxfer.master")

# Flags an environment can set instead (a unit's EnvironmentFile, a pod's env); a flag given wins.
# Names of their own, so a master and a vLLM instance can share one environment file.
ENV_FALLBACKS = {"host": "PDXFER_MASTER_LISTEN_HOST", "port": "PDXFER_MASTER_LISTEN_PORT",
                 "http_host": "PDXFER_MASTER_HTTP_HOST", "http_port": "PDXFER_MASTER_HTTP_PORT",
                 "advertise": "PDXFER_MASTER_ADVERTISE"}
_DEFAULTS = {"host": "127.0.0.1", "port": "0", "http_host": None, "http_port": "0", "advertise": None}


def _write_port_file(path: str, port: int, http_port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n{http_port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdxfer-master", description="pdxfer chunk index service",
                                formatter_class=HelpFormatter)
    env = ENV_FALLBACKS
    p.add_argument("--host", help=f"address to listen on for the wire protocol (${env['host']}; "
                                  "default 127.0.0.1)")
    p.add_argument("--port", help=f"wire protocol port: 0 (chosen by the OS), N, or a range N-M, the first "
                                  f"free one is taken (${env['port']}; default 0)")
    p.add_argument("--port-file", help="write '<port>\\n<http port>\\n' here once listening")
    p.add_argument("--http-host", help=f"address for /metrics and /health (${env['http_host']}; "
                                       "default: --host)")
    p.add_argument("--http-port", help=f"HTTP port (0: chosen by the OS, -1: off; ${env['http_port']}; "
                                       "default 0)")
    p.add_argument("--advertise", help=f"HOST:PORT, or HOST with a fixed --port, published as the leader "
                                       f"address in etcd (${env['advertise']}; default host:port)")
    p.add_argument("--token-file", help="shared secret every request must carry")
    tenv = master_tls.SERVER_ENV
    p.add_argument("--tls-cert", help=f"PEM server certificate (chain): the wire and HTTP ports serve TLS "
                                      f"(${tenv['tls_cert']})")
    p.add_argument("--tls-key", help=f"PEM private key of --tls-cert (${tenv['tls_key']})")
    p.add_argument("--tls-client-ca", help=f"PEM CA: wire clients must present a certificate it signed "
                                           f"(${tenv['tls_client_ca']})")
    p.add_argument("--http-tls", choices=("0", "1"), help=f"0: the HTTP port stays plain while the wire serves "
                                                          f"TLS (${tenv['http_tls']}; default 1)")
    p.add_argument("--etcd", help="host:port[,host:port] of etcd: HA mode (default: standalone, in memory)")
    p.add_argument("--etcd-prefix", default="/pdxfer/master", help="key prefix in etcd")
    for opt, (_, var) in etcd_security.OPTIONS.items():  # TLS and auth towards etcd (docs/master.md)
        p.add_argument(f"--etcd-{opt}", dest=f"etcd_opt_{opt}", metavar=opt.split("-")[-1].upper(),
                       help=f"{etcd_security.HELP[opt]} (${var}; etcd:// option {opt}=)")
    p.add_argument("--leader-ttl", type=float, default=5.0, help="leader lease TTL in seconds (etcd mode)")
    p.add_argument("--etcd-timeout", type=float, default=1.0, help="per-call etcd timeout in seconds")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (for hit_tokens only)")
    p.add_argument("--max-entries", type=int, default=10_000_000, help="refuse publishes beyond this")
    p.add_argument("--max-lock-ttl", type=float, default=DEFAULT_MAX_LOCK_TTL_S,
                   help="cap on reader lock TTLs in seconds, announced to holders at registration")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="serve on a non-loopback address without --token-file (anyone who reaches the "
                        "port reads every holder's metadata and can publish locations); refused otherwise")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="concurrent client connections; at the cap the oldest connection that has not "
                        "proven itself (hello with the token) is cut for a newcomer, and only clients "
                        "that have fill it refuse one (logged)")
    p.add_argument("--max-unproven-per-peer", type=int, default=DEFAULT_MAX_UNPROVEN_PER_PEER,
                   help="connections one address may hold before they prove themselves; its oldest is "
                        "cut for its newest")
    p.add_argument("--handshake-timeout", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT_S,
                   help="seconds a new connection has to send its first frame (hello)")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help="seconds an authenticated connection may stay idle")
    add_log_level(p)
    return p


def apply_env_fallbacks(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """Fill the listen/advertise flags not given from ENV_FALLBACKS, then defaults; check them.
    ``args.port`` becomes a PortRange, ``args.http_port`` an int; a bad value exits naming the
    flag or variable it came from."""
    env = os.environ if env is None else env
    source: dict[str, str] = {}
    for key, var in ENV_FALLBACKS.items():
        if getattr(args, key) is not None:
            source[key] = f"--{key.replace('_', '-')}"
        elif env.get(var, "").strip():
            setattr(args, key, env[var].strip())
            source[key] = f"${var}"
        else:
            setattr(args, key, _DEFAULTS[key])
            source[key] = f"--{key.replace('_', '-')}"
    args.port_source = source["port"]
    try:
        args.port = parse_port_spec(args.port, source["port"])
    except PortSpecError as exc:
        raise SystemExit(f"pdxfer-master: {exc}") from None
    try:
        args.http_port = int(str(args.http_port).strip(), 10)
        if not -1 <= args.http_port <= 65535:
            raise ValueError
    except ValueError:
        raise SystemExit(f"pdxfer-master: {source['http_port']} must be -1 (off), 0 (any free port) or a "
                         f"port 1-65535, got {args.http_port!r}") from None
    if args.advertise is not None and _split_port(args.advertise) is None and args.port.any:
        raise SystemExit(f"pdxfer-master: {source['advertise']} {args.advertise!r} has no port and the wire "
                         f"port is chosen by the OS; give HOST:PORT or a fixed --port")


def apply_tls_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """``args.tls`` from the TLS flags, then their variables (None: plain); exits naming a bad one."""
    env = os.environ if env is None else env
    try:
        args.tls = master_tls.server_tls_from(args.tls_cert, args.tls_key, args.tls_client_ca, env)
    except ValueError as exc:
        raise SystemExit(f"pdxfer-master: {exc}") from None
    var = master_tls.SERVER_ENV["http_tls"]
    if args.http_tls is None and env.get(var, "").strip():
        args.http_tls = env[var].strip()
        if args.http_tls not in ("0", "1"):
            raise SystemExit(f"pdxfer-master: ${var} must be 0 or 1, got {args.http_tls!r}")


def _split_port(hostport: str) -> int | None:
    """The port of "host:port" / "[v6]:port"; None when there is none."""
    head, sep, tail = hostport.rpartition(":")
    if not sep or not tail.isdigit() or (":" in head and not head.endswith("]")):
        return None
    return int(tail)


def _advertise_for(advertise: str | None, port: int) -> str | None:
    if advertise is None or _split_port(advertise) is not None:
        return advertise
    return f"{advertise}:{port}"


async def _start_on_range(svc: MasterService, args: argparse.Namespace) -> None:
    """Start on the first free port of ``args.port``; only the wire port moves along the range."""
    spec: PortRange = args.port
    for port in spec.ports():
        try:
            await svc.start(args.host, port, args.http_host, args.http_port, _advertise_for(args.advertise, port),
                            args.tls, args.http_tls != "0")
            return
        except OSError as exc:
            # svc.port stays 0 until the wire socket is bound: a failure after that (the HTTP
            # port, etcd) is not the range's business.
            if svc.port:
                if exc.errno == errno.EADDRINUSE:
                    raise SystemExit(f"pdxfer-master: HTTP port {args.http_port} on {args.http_host or args.host} "
                                     f"is in use (--http-port, $PDXFER_MASTER_HTTP_PORT)") from None
                raise
            if exc.errno != errno.EADDRINUSE or spec.any:
                raise SystemExit(f"pdxfer-master: cannot listen on {args.host}:{port}: {exc}") from None
    what = f"port {spec} of {args.port_source}" if spec.first == spec.last else \
        f"every port of {args.port_source} {spec}"
    raise SystemExit(f"pdxfer-master: {what} on {args.host} is in use; free it or give a range N-M")


def _read_token(path: str) -> str:
    try:
        return read_secret_file(path, "token file")
    except SecretFileError as exc:
        raise SystemExit(f"pdxfer-master: {exc}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or a wildcard) other hosts may reach


def check_token_policy(host: str, has_token: bool, insecure_no_token: bool) -> None:
    """Refuse (SystemExit) a master other hosts can reach without a token, unless told to run so;
    warn loudly when it is."""
    if has_token or _is_loopback(host):
        return
    if not insecure_no_token:
        raise SystemExit(f"pdxfer-master: refusing to listen on {host or 'every address'} without --token-file: "
                         "anyone who reaches the port would read every holder's metadata and could publish "
                         "locations that readers trust. Give --token-file F (create one with `pdxfer-token "
                         "ensure F`), listen on 127.0.0.1, or pass --insecure-no-token to run without one")
    log.warning("pdxfer-master: listening on %s WITHOUT A TOKEN (--insecure-no-token): every peer that reaches "
                "it is trusted; use --token-file in production", host or "every address")


async def _amain(args: argparse.Namespace) -> None:
    check_token_policy(args.host, bool(args.token_file), args.insecure_no_token)
    if args.etcd and not args.advertise and args.host in ("0.0.0.0", "::", ""):
        raise SystemExit("pdxfer-master: listening on a wildcard address; give --advertise HOST:PORT so "
                         "clients that find the leader in etcd can reach it")
    given = {opt: getattr(args, f"etcd_opt_{opt}") for opt in etcd_security.OPTIONS}
    url = etcd_layout.etcd_url(args.etcd, args.etcd_prefix) + etcd_security.options_query(given) if args.etcd else None
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
            max_unproven_per_peer=args.max_unproven_per_peer,
        )
    except ValueError as exc:
        raise SystemExit(f"pdxfer-master: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await _start_on_range(svc, args)
    if args.port_file:
        _write_port_file(args.port_file, svc.port, svc.http_port)
    log.info("pdxfer-master listening on %s:%d (http %d, store %s)", args.host, svc.port, svc.http_port,
             svc.coord.kind)
    await stop.wait()
    log.info("shutting down")
    await svc.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_env_fallbacks(args)
    apply_tls_settings(args)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=LOG_FORMAT)
    try:
        # libuv's loop: each request costs the master a receive, a send and an epoll turn, which
        # asyncio's own loop spends several Python calls on.
        uvloop.run(_amain(args))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK
