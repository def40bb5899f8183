"""`pdxfer status`: what a running master knows, for operators (read-only, token-authenticated).

Fetching goes through the normal client (``MasterClient.status``); this module only parses the
command line, maps failures to exit codes and formats the reply (an 80-column table or JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from pdxfer.common.cli_common import HelpFormatter, add_log_level, apply_log_level
from pdxfer.common.secret_file import SecretFileError, read_secret_file
from pdxfer.master.wire.errors import MasterAuthError, MasterError, MasterUnavailable

MASTER_ENV = "PDXFER_MASTER"  # the same variables the vLLM connector reads
TOKEN_FILE_ENV = "PDXFER_MASTER_TOKEN_FILE"
DEFAULT_TIMEOUT_S = 5.0

EXIT_OK = 0
EXIT_USAGE = 2  # argparse's, and a token file that cannot be read
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4
EXIT_NO_LEADER = 5  # the master answered but nobody leads, or it runs degraded
EXIT_PROTOCOL = 6

EPILOG = f"""\
exit codes:
  {EXIT_OK}  the master answered and leads (healthy)
  {EXIT_USAGE}  bad arguments, or the token file cannot be read
  {EXIT_UNREACHABLE}  no master answered within --timeout
  {EXIT_AUTH}  the master refused the token (missing or wrong); nothing else is printed
  {EXIT_NO_LEADER}  the master answered but is not leading or is degraded (etcd unreachable)
  {EXIT_PROTOCOL}  the master's reply could not be understood (version mismatch?)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdxfer status", description="Show the master's leader and every live node.",
                                epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--master", default=None, metavar="ADDRESS",
                   help=f"HOST:PORT or etcd://HOST:PORT[,...]/PREFIX (default ${MASTER_ENV})")
    p.add_argument("--token-file", default=None, help=f"the master's shared secret (default ${TOKEN_FILE_ENV})")
    p.add_argument("--ca-file", default=None, help="CA of the master's TLS certificate ($PDXFER_MASTER_CA_FILE)")
    p.add_argument("--cert-file", default=None, help="client certificate ($PDXFER_MASTER_CERT_FILE)")
    p.add_argument("--key-file", default=None, help="key of --cert-file ($PDXFER_MASTER_KEY_FILE)")
    p.add_argument("--server-name", default=None, help="name the master's certificate must carry")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="bound of connecting and asking, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_log_level(p, default="WARNING")
    return p


def fetch(address: str, token: str | None, timeout_s: float, tls: dict[str, str | None]) -> dict[str, Any]:
    from pdxfer.master.client.master_client import MasterClient

    with MasterClient(address, token=token, timeout_s=timeout_s, **tls) as c:
        return c.status()


def healthy(doc: dict[str, Any]) -> bool:
    m = doc["master"]
    return bool(m.get("leader")) and not m.get("degraded")


def _cut(text: Any, width: int) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= width else s[: width - 1] + "~"


def format_table(doc: dict[str, Any]) -> str:
    """The human view; every line at most 80 columns."""
    m = doc["master"]
    state = "leader" if m.get("leader") else "NOT LEADING"
    if m.get("degraded"):
        state += ", DEGRADED"
    lines = [_cut(f"master: {m.get('store')} store, {state}, leader {m.get('leader_address') or 'this replica'}"
                  f", epoch {m.get('epoch', 0):#x}", 80),
             _cut(f"replica {m.get('replica_id') or '-'}, up {m.get('uptime_s', 0):.0f}s, "
                  f"{len(doc['nodes'])} live nodes, {m.get('locks', 0)} locks", 80)]
    if m.get("degraded"):
        lines.append(_cut(f"degraded: {m['degraded']}", 80))
    lines.append("")
    head = f"{'NODE':<20} {'ROLE':<11} {'XPORT':<5} {'CHUNKS':>7} {'BLOCKS':>8} {'LOCKS':>5} {'HB AGO':>6} {'LEASE':>6}"
    lines.append(head)
    for n in doc["nodes"]:
        role = (n.get("role") or "-").removeprefix("kv_")
        lines.append(f"{_cut(n['node_id'], 20):<20} {_cut(role, 11):<11} {_cut(n.get('transport') or '-', 5):<5} "
                     f"{n['entries']:>7} {n['blocks']:>8} {n['locks']:>5} {n['heartbeat_age_s']:>5.1f}s "
                     f"{n['lease_left_s']:>5.1f}s")
        lay = n.get("layout") or {}
        eps = ",".join(e["endpoint"] for e in n.get("endpoints") or () if e.get("endpoint")) or "-"
        lines.append(_cut(f"  url {n.get('serve_url') or '-'}  kv {eps}", 80))
        lines.append(_cut(f"  block {lay.get('block_size') or '-'} {lay.get('dtype') or '-'} "
                          f"kvh {lay.get('kv_heads') or '-'} tp {lay.get('tp', 1)} ct {lay.get('chunk_tokens') or '-'}"
                          f" ns {_cut(lay.get('namespace') or '-', 13)} epoch {n['epoch']:#x}", 80))
    return "\n".join(lines)


def _read_token(path: str | None) -> str | None:
    return read_secret_file(path, "token file") if path else None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_log_level(args.log_level)
    address = args.master or os.environ.get(MASTER_ENV, "").strip()
    if not address:
        print(f"pdxfer status: give --master or ${MASTER_ENV}", file=sys.stderr)
        return EXIT_USAGE
    if args.timeout <= 0:
        print(f"pdxfer status: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return EXIT_USAGE
    token_file = args.token_file or os.environ.get(TOKEN_FILE_ENV, "").strip() or None
    try:
        token = _read_token(token_file)
    except SecretFileError as exc:
        print(f"pdxfer status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file,
           "server_name": args.server_name}
    try:
        doc = fetch(address, token, args.timeout, tls)
    except MasterAuthError as exc:
        print(f"pdxfer status: {address} refused the token: {exc}", file=sys.stderr)
        return EXIT_AUTH
    except MasterUnavailable as exc:
        print(f"pdxfer status: no master answered at {address} within {args.timeout}s: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MasterError as exc:
        print(f"pdxfer status: {address}: {exc}", file=sys.stderr)
        return EXIT_PROTOCOL
    except ValueError as exc:  # a malformed address or TLS setting, named by the client
        print(f"pdxfer status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(doc, sort_keys=True) if args.json else format_table(doc))
    return EXIT_OK if healthy(doc) else EXIT_NO_LEADER
