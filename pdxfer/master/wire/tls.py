"""TLS on the master's own ports: the server's settings (certificate, key, optional CA that client
certificates must chain to), a client's (CA to verify the master by, optional client certificate),
their environment fallbacks, and the words for what a failed handshake refused.

A client verifies the master's certificate against the name it connects to (the host of
``host:port``, or of the leader address a replica group publishes in etcd), unless a server name
is given for it to expect instead.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Mapping

from pdxfer.master.wire.errors import MasterUnavailable

# Server side: flag -> environment variable (pdxfer-master reads the variable when the flag is absent).
SERVER_ENV = {"tls_cert": "PDXFER_MASTER_TLS_CERT", "tls_key": "PDXFER_MASTER_TLS_KEY",
              "tls_client_ca": "PDXFER_MASTER_TLS_CLIENT_CA", "http_tls": "PDXFER_MASTER_HTTP_TLS"}
# Client side: MasterClient argument -> environment variable.
CLIENT_ENV = {"ca_file": "PDXFER_MASTER_CA_FILE", "cert_file": "PDXFER_MASTER_CERT_FILE",
              "key_file": "PDXFER_MASTER_KEY_FILE", "server_name": "PDXFER_MASTER_SERVER_NAME"}


def _readable(path: str, where: str) -> None:
    if not os.access(path, os.R_OK) or not os.path.isfile(path):
        raise ValueError(f"{where} {path}: not a readable file")


@dataclass(frozen=True)
class ServerTls:
    """What the master presents, and (with ``client_ca_file``) which client certificates it accepts."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def context(self, require_client_cert: bool | str = True) -> ssl.SSLContext:
        """A server context; ValueError naming the file that does not load. ``require_client_cert``:
        "reply" when the caller refuses a connection without a certificate itself."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"TLS certificate {self.cert_file} with key {self.key_file} cannot be "
                             f"loaded: {exc}") from None
        if self.client_ca_file and require_client_cert:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"TLS client CA {self.client_ca_file} cannot be loaded: {exc}") from None
            # OPTIONAL, and a missing certificate refused by the connection with a reply saying so:
            # asyncio drops the TLS alert of a failed handshake, so the client would only see a
            # closed connection. A certificate that does not verify still fails the handshake.
            ctx.verify_mode = ssl.CERT_OPTIONAL if require_client_cert == "reply" else ssl.CERT_REQUIRED
        return ctx


def server_tls_from(cert: str | None, key: str | None, client_ca: str | None,
                    env: Mapping[str, str] | None = None) -> ServerTls | None:
    """The master's TLS settings from flags (given first), then the environment; None: plain.
    ValueError naming the flag or variable that is wrong."""
    env = os.environ if env is None else env
    values: dict[str, str | None] = {}
    where: dict[str, str] = {}
    for name, given in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", client_ca)):
        var = SERVER_ENV[name]
        if given is None and env.get(var, "").strip():
            given, where[name] = env[var].strip(), f"${var}"
        else:
            where[name] = "--" + name.replace("_", "-")
        values[name] = given
    if not values["tls_cert"] and not values["tls_key"]:
        if values["tls_client_ca"]:
            raise ValueError(f"{where['tls_client_ca']} needs a server certificate: give --tls-cert and --tls-key "
                             f"(${SERVER_ENV['tls_cert']}, ${SERVER_ENV['tls_key']})")
        return None
    if not values["tls_cert"] or not values["tls_key"]:
        raise ValueError(f"TLS needs both a certificate and its key: --tls-cert and --tls-key "
                         f"(${SERVER_ENV['tls_cert']}, ${SERVER_ENV['tls_key']})")
    for name, path in values.items():
        if path:
            _readable(path, where[name])
    tls = ServerTls(values["tls_cert"], values["tls_key"], values["tls_client_ca"])  # type: ignore[arg-type]
    tls.context()  # a file that does not load stops the master now, not at the first client
    return tls


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies the master (``ca_file``; None: the system CAs) and what it presents."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # the name the master's certificate must carry (default: the host dialled)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)  # verifies the chain and the server name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def ca_note(self) -> str:
        return f"CA file {self.ca_file}" if self.ca_file else \
            f"no CA file given (ca_file / ${CLIENT_ENV['ca_file']}), so only the system CAs are trusted"

    def cert_note(self) -> str:
        return f"client certificate {self.cert_file}" if self.cert_file else \
            f"no client certificate given (cert_file/key_file, ${CLIENT_ENV['cert_file']}/${CLIENT_ENV['key_file']})"


def client_tls_from(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                    server_name: str | None = None, env: Mapping[str, str] | None = None) -> ClientTls | None:
    """A client's TLS settings from arguments (given first), then the environment; None: plain.
    TLS is on when a CA or a client certificate is given. ValueError naming what is wrong."""
    env = os.environ if env is None else env
    given = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "server_name": server_name}
    where: dict[str, str] = {}
    for name, value in given.items():
        var = CLIENT_ENV[name]
        if value is None and env.get(var, "").strip():
            given[name], where[name] = env[var].strip(), f"${var}"
        else:
            where[name] = name
    given = {k: v or None for k, v in given.items()}  # "" given: not set, and no environment fallback
    if not given["ca_file"] and not given["cert_file"] and not given["key_file"]:
        return None
    if bool(given["cert_file"]) != bool(given["key_file"]):
        raise ValueError("a master client certificate needs its key and a key its certificate: give both "
                         f"cert_file and key_file (${CLIENT_ENV['cert_file']}, ${CLIENT_ENV['key_file']})")
    for name in ("ca_file", "cert_file", "key_file"):
        if given[name]:
            _readable(given[name], where[name])  # type: ignore[arg-type]
    tls = ClientTls(**given)
    try:
        tls.context()
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"master TLS files ({tls.ca_note()}, {tls.cert_note()}) cannot be loaded: {exc}") from None
    return tls


class MasterTlsError(MasterUnavailable):
    """The TLS handshake with the master failed (untrusted certificate, a client certificate
    refused, one side plain): a setting to fix, named in the message, not an outage."""


def explain_client_error(where: str, exc: BaseException, tls: ClientTls | None) -> str | None:
    """What a failed exchange with the master at ``where`` refused, when it was TLS; else None."""
    text = str(exc)
    low = text.lower()
    if tls is None:
        return None
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate verify failed" in low:
        return f"master at {where}: its TLS certificate is not trusted with {tls.ca_note()} ({text[:200]})"
    if "wrong version number" in low or "wrong_version_number" in low \
            or "record layer failure" in low or "packet length too long" in low:
        return (f"master at {where} does not serve TLS but this client uses TLS ({tls.ca_note()}); "
                f"drop the client's TLS settings or start the master with --tls-cert/--tls-key ({text[:200]})")
    if any(s in low for s in ("alert certificate required", "alert bad certificate", "alert unknown ca",
                              "alert_certificate_required", "alert_bad_certificate", "alert_unknown_ca",
                              "tlsv13 alert", "tlsv1 alert", "sslv3 alert")):
        return f"master at {where} refused the TLS handshake: {tls.cert_note()} was not accepted ({text[:200]})"
    if isinstance(exc, ssl.SSLError):
        return f"master at {where}: TLS failed with {tls.cert_note()} and {tls.ca_note()} ({text[:200]})"
    return None


def closed_after_handshake(where: str, tls: ClientTls) -> str:
    """Words for a TLS connection the master closed before any reply: it did not accept the
    certificate this client presented (asyncio servers send no alert for it)."""
    return (f"master at {where} closed the TLS connection before answering: it did not accept "
            f"{tls.cert_note()} (not signed by its --tls-client-ca?); its log says more")


def looks_like_tls(data: bytes) -> bool:
    """True for the first bytes of a TLS record (an alert or handshake): a plain client dialled a
    master that serves TLS."""
    return len(data) >= 3 and data[0] in (0x15, 0x16) and data[1] == 0x03 and data[2] <= 0x04
