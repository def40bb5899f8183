"""Where a client finds the master, chosen by the address's scheme.

``host:port`` names one master. ``etcd://host:port[,host:port]/prefix`` names a replica group:
the current leader's address is read from etcd (through etcd's JSON gateway with the stdlib, so
clients need neither grpc nor an event loop) and read again whenever the client is told to. The
URL's options name the TLS files and etcd user (``etcd_security.py``).
"""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

from pdxfer.master.backends import etcd_layout
from pdxfer.master.backends.etcd_security import EtcdRefused, explain_auth_error, explain_tls_error
from pdxfer.master.wire.errors import MasterUnavailable
from pdxfer.master.wire.protocol import parse_hostport


class StaticLocator:
    """One master at a fixed address; nothing to follow."""

    follows_leader = False

    def __init__(self, address: str) -> None:
        self.addr = parse_hostport(address)

    def locate(self, timeout_s: float) -> tuple[str, int]:
        return self.addr

    def __str__(self) -> str:
        return "%s:%d" % self.addr


class EtcdLocator:
    """The leader that a replica group publishes in etcd, read over TLS and with etcd auth when
    the URL's options (or their environment variables) ask for them."""

    follows_leader = True

    def __init__(self, url: str) -> None:
        self.target = etcd_layout.parse_etcd_url(url)
        sec = self.target.security
        try:
            self._ssl = sec.ssl_context() if sec.tls else None
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"etcd TLS files ({sec.ca_note()}, {sec.cert_note()}, key {sec.key_file}) "
                             f"cannot be loaded: {exc}") from None
        self._tokens: dict[tuple[str, int], str] = {}  # auth token per endpoint (tokens are per member)

    def locate(self, timeout_s: float) -> tuple[str, int]:
        """The leader's address now; MasterUnavailable when no endpoint answers or nobody leads,
        EtcdRefused (a MasterUnavailable) naming what etcd or the TLS handshake refused when no
        endpoint answered and one refused."""
        prefix = self.target.prefix
        key = base64.b64encode(etcd_layout.leader_key(prefix)).decode()
        deadline = time.monotonic() + max(timeout_s, 0.05)
        last: str | None = None
        refused: str | None = None
        endpoints = self.target.endpoints
        for i, (host, port) in enumerate(endpoints):
            # An equal share of what is left: a member cut off by the network (it accepts nothing,
            # answers nothing) must not use up the time of the healthy ones after it.
            now = time.monotonic()
            share = now + max((deadline - now) / (len(endpoints) - i), 0.05)  # the last: all that is left
            try:
                doc = self._range(host, port, key, share)
            except EtcdRefusedError as exc:
                refused = str(exc)
                continue
            except (OSError, ValueError) as exc:
                last = f"{host}:{port}: {exc}"
                continue
            kvs = doc.get("kvs") or []
            if not kvs:
                raise MasterUnavailable(f"no leader published under {prefix} in etcd")
            try:
                return parse_hostport(etcd_layout.decode_leader(base64.b64decode(kvs[0]["value"])).addr)
            except (ValueError, KeyError, TypeError) as exc:
                raise MasterUnavailable(f"leader record under {prefix} in etcd is malformed: {exc}") from None
        if refused is not None:
            raise EtcdRefusedError(refused + (f"; other endpoints: {last}" if last else ""))
        raise MasterUnavailable(f"no etcd endpoint answered: {last}")

    def _range(self, host: str, port: int, key: str, deadline: float, fresh: bool = False) -> dict[str, Any]:
        sec = self.target.security
        if sec.user and (host, port) not in self._tokens:
            try:
                password = sec.read_password()
            except EtcdRefused as exc:
                raise EtcdRefusedError(str(exc)) from None
            reply = self._post(host, port, "/v3/auth/authenticate", {"name": sec.user, "password": password},
                               None, deadline)
            self._tokens[(host, port)] = reply["token"]
            fresh = True
        try:
            return self._post(host, port, "/v3/kv/range", {"key": key}, self._tokens.get((host, port)), deadline)
        except EtcdRefusedError:
            if self._tokens.pop((host, port), None) is None or fresh:
                raise
        # A cached token etcd no longer knows (it drops idle ones): authenticate once more.
        return self._range(host, port, key, deadline, fresh=True)

    def _post(self, host: str, port: int, path: str, body: dict[str, Any], token: str | None,
              deadline: float) -> dict[str, Any]:
        sec = self.target.security
        where = f"{host}:{port}"
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        req = urllib.request.Request(f"{sec.scheme}://{host}:{port}{path}", data=json.dumps(body).encode(),
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=max(deadline - time.monotonic(), 0.05),
                                        context=self._ssl) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            message = _etcd_message(exc)
            why = explain_auth_error(where, message, sec) or explain_tls_error(where, message, sec)
            if why is not None:
                raise EtcdRefusedError(why) from None
            raise OSError(f"etcd answered {exc.code}: {message}") from None
        except (ssl.SSLError, urllib.error.URLError, ConnectionResetError) as exc:
            cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            why = explain_tls_error(where, cause, sec) if isinstance(cause, (ssl.SSLError, OSError)) else None
            if why is not None:
                raise EtcdRefusedError(why) from None
            raise OSError(str(cause)) from None

    def __str__(self) -> str:
        return etcd_layout.SCHEME + ",".join("%s:%d" % ep for ep in self.target.endpoints) + self.target.prefix


class EtcdRefusedError(MasterUnavailable):
    """etcd, or the TLS handshake with it, refused this client: its message names the setting."""


def _etcd_message(exc: urllib.error.HTTPError) -> str:
    body = exc.read()[:500]
    try:
        return str(json.loads(body).get("error") or body)
    except ValueError:
        return body.decode(errors="replace").strip() or f"HTTP {exc.code}"


def locator_for(address: str) -> StaticLocator | EtcdLocator:
    """ValueError naming the address when it is neither host:port nor an etcd:// URL."""
    if address.startswith(etcd_layout.SCHEME):
        return EtcdLocator(address)
    if "://" in address:
        raise ValueError(f"master address {address!r}: unknown scheme (host:port or {etcd_layout.SCHEME}...)")
    return StaticLocator(address)
