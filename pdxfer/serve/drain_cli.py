"""``pdxfer drain INSTANCE --proxy URL``: take an instance out of the proxy's rotation and wait
(bounded) until its requests in flight have finished; then it can be stopped without failing a
request (see :mod:`pdxfer.serve.drain`). Exit 0 once drained, 1 when requests are still in flight
at ``--timeout``, 2 when the proxy refused or could not be reached (the reason printed)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from pdxfer.common.secret_file import read_secret_file
from pdxfer.serve.drain import DRAIN_PATH


class DrainFailed(RuntimeError):
    pass


def _call(proxy: str, token: str | None, method: str, query: str = "", body: dict | None = None,
          timeout: float = 5.0) -> dict[str, Any]:
    url = proxy.rstrip("/") + DRAIN_PATH + query
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = e.reason
        raise DrainFailed(f"the proxy at {proxy} answered HTTP {e.code}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DrainFailed(f"cannot reach the proxy at {proxy}: {e}") from None


def drain(proxy: str, instance: str, token: str | None = None, timeout_s: float = 120.0,
          undo: bool = False, poll_s: float = 0.2) -> dict[str, Any]:
    """Drain ``instance`` (or put it back, ``undo``); the proxy's last word on it once nothing is
    in flight. DrainFailed when the proxy refuses, or when requests are left at ``timeout_s``."""
    state = _call(proxy, token, "POST", body={"url": instance, "undo": undo})
    if undo:
        return state
    deadline = time.monotonic() + timeout_s
    query = "?" + urllib.parse.urlencode({"url": instance})
    while state["in_flight"] > 0:
        if time.monotonic() >= deadline:
            raise DrainFailed(f"{instance} still has {state['in_flight']} requests in flight after {timeout_s:g} s "
                              "(it stays out of rotation; run again to wait longer)")
        time.sleep(poll_s)
        state = _call(proxy, token, "GET", query=query)
    return state


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdxfer drain", description=__doc__.splitlines()[0])
    ap.add_argument("instance", help="the instance's URL as the proxy knows it (e.g. http://10.0.0.5:8100)")
    ap.add_argument("--proxy", required=True, help="the proxy's URL (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--token-file", type=Path, default=None,
                    help="the fleet's token (the proxy's --master-token-file); without one the proxy "
                         "accepts drains from its own host only")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for requests in flight")
    ap.add_argument("--undo", action="store_true", help="put the instance back in rotation")
    args = ap.parse_args(argv)
    token = read_secret_file(args.token_file, "--token-file") if args.token_file is not None else None
    try:
        state = drain(args.proxy, args.instance, token, args.timeout, args.undo)
    except DrainFailed as e:
        print(f"pdxfer drain: {e}", file=sys.stderr)
        return 1 if "in flight" in str(e) else 2
    if args.undo:
        print(f"{state['role']} instance {state['url']} is back in rotation")
    else:
        print(f"{state['role']} instance {state['url']} is drained: nothing in flight, no new requests. Stop it "
              "now; once it is healthy again (restarted) the proxy routes to it by itself")
    return 0
