"""How pdxfer reaches a secured etcd: TLS (CA, client certificate) and etcd auth (user, password
file), the settings' sources (``etcd://`` URL options, then environment variables), and the
messages that say what etcd, or our side of the handshake, refused.

    etcd://HOST:PORT[,HOST:PORT]/PREFIX?ca=FILE&cert=FILE&key=FILE&user=NAME&password-file=FILE

Each option falls back to an environment variable (``ENV``) when the URL does not give it, so
one environment file serves a master and the instances that follow it. TLS is on when a CA or a
client certificate is given, or with ``tls=1`` (server TLS checked against the system CAs).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import parse_qsl, urlencode

from pdxfer.common.secret_file import SecretFileError, read_secret_file

# URL option -> (field, environment variable)
OPTIONS = {
    "ca": ("ca_file", "PDXFER_ETCD_CA_FILE"),
    "cert": ("cert_file", "PDXFER_ETCD_CERT_FILE"),
    "key": ("key_file", "PDXFER_ETCD_KEY_FILE"),
    "user": ("user", "PDXFER_ETCD_USER"),
    "password-file": ("password_file", "PDXFER_ETCD_PASSWORD_FILE"),
    "tls": ("tls_flag", "PDXFER_ETCD_TLS"),
}
ENV = {opt: var for opt, (_, var) in OPTIONS.items()}
HELP = {
    "ca": "PEM file of the CA that signed etcd's server certificates (turns TLS on)",
    "cert": "PEM client certificate presented to etcd (with its key; turns TLS on)",
    "key": "PEM private key of the client certificate",
    "user": "etcd auth user (with a password file)",
    "password-file": "file holding the etcd user's password (read at each authentication)",
    "tls": "1: TLS with the system CAs when no CA is given; 0: plain (default: on with a CA or cert)",
}
_FILES = ("ca_file", "cert_file", "key_file", "password_file")


@dataclass(frozen=True)
class EtcdSecurity:
    """What a client presents to etcd; all empty: plain HTTP/gRPC without auth."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password_file: str | None = None
    tls_flag: str | None = None  # "1"/"0" as given; None: inferred

    @property
    def tls(self) -> bool:
        if self.tls_flag is not None:
            return self.tls_flag == "1"
        return bool(self.ca_file or self.cert_file)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def read_password(self) -> str:
        """The password, read now (a rotated file is picked up on the next authentication)."""
        assert self.password_file is not None
        try:
            return read_secret_file(self.password_file, "etcd password file")
        except SecretFileError as exc:
            raise EtcdRefused(str(exc)) from None

    def query(self) -> str:
        """The URL options that give these settings ("" when none)."""
        return options_query({opt: getattr(self, name) for opt, (name, _) in OPTIONS.items()})

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies etcd's certificate (against the CA file, or the system CAs) and presents ours."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def read_pem(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(CA, key, cert chain) bytes for gRPC's channel credentials."""
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()
        return read(self.ca_file), read(self.key_file), read(self.cert_file)

    # ---- what was refused, in words -------------------------------------------------------------

    def ca_note(self) -> str:
        return f"CA file {self.ca_file}" if self.ca_file else \
            f"no CA file given (ca= or ${ENV['ca']}), so only the system CAs are trusted"

    def cert_note(self) -> str:
        return f"client certificate {self.cert_file}" if self.cert_file else \
            f"no client certificate given (cert=/key= or ${ENV['cert']}/${ENV['key']})"

    def user_note(self) -> str:
        return f"user {self.user!r} (password file {self.password_file})" if self.user else \
            f"no etcd user given (user=/password-file= or ${ENV['user']}/${ENV['password-file']})"


class EtcdRefused(ConnectionError):
    """etcd, or the TLS handshake with it, refused this client: a setting to fix, not an outage."""


def explain_tls_error(where: str, exc: BaseException | str, sec: EtcdSecurity) -> str | None:
    """The refusal behind a TLS failure text (from Python's ssl or gRPC's), or None when it is
    no TLS refusal (etcd down, a timeout)."""
    text = str(exc)
    low = text.lower()
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        return f"etcd at {where}: its server certificate is not trusted with {sec.ca_note()} ({text[:200]})"
    if "wrong_version_number" in low or "wrong version number" in low or "http request to an https" in low:
        return (f"etcd at {where} and this client disagree on TLS (this client uses {sec.scheme}; "
                f"set ca=/cert= or tls=1 for an etcd that serves TLS) ({text[:200]})")
    if any(s in low for s in ("alert bad certificate", "alert unknown ca", "alert certificate required",
                              "alert_bad_certificate", "alert_unknown_ca", "alert_certificate_required",
                              "tlsv1 alert", "tlsv13 alert", "sslv3 alert")):
        return f"etcd at {where} refused the TLS handshake: {sec.cert_note()} was not accepted ({text[:200]})"
    if "ssl" in low and "handshake" in low:
        return f"etcd at {where}: TLS handshake failed with {sec.cert_note()} and {sec.ca_note()} ({text[:200]})"
    return None


def explain_auth_error(where: str, message: str, sec: EtcdSecurity) -> str | None:
    """The refusal behind an etcd error message about auth or permissions, else None."""
    low = message.lower()
    if "authentication failed" in low or "invalid user id or password" in low:
        return f"etcd at {where} refused {sec.user_note()}: {message}"
    if "user name is empty" in low or "user name not found" in low or "invalid auth token" in low:
        return f"etcd at {where} requires authentication: {sec.user_note()} ({message})"
    if "permission denied" in low:
        return f"etcd at {where} denied access to pdxfer's keys ({sec.user_note()}): {message}"
    if "authentication is not enabled" in low:
        return f"etcd at {where} has auth disabled but {sec.user_note()} was given: {message}"
    return None


def security_from(options: Mapping[str, str], env: Mapping[str, str] | None = None) -> EtcdSecurity:
    """Settings from URL ``options`` (given first), then ``env``; ValueError naming a bad one."""
    env = os.environ if env is None else env
    values: dict[str, str | None] = {}
    source: dict[str, str] = {}
    for opt in options:
        if opt not in OPTIONS:
            raise ValueError(f"unknown etcd option {opt!r} (known: {', '.join(OPTIONS)})")
    for opt, (name, var) in OPTIONS.items():
        value = options.get(opt)
        where = f"etcd option {opt}="
        if value is None and env.get(var, "").strip():
            value, where = env[var].strip(), f"${var}"
        if value is not None and not value.strip():
            raise ValueError(f"{where} is empty")
        values[name], source[name] = value, where
    sec = EtcdSecurity(**values)
    if sec.tls_flag not in (None, "0", "1"):
        raise ValueError(f"{source['tls_flag']} must be 0 or 1, got {sec.tls_flag!r}")
    if bool(sec.cert_file) != bool(sec.key_file):
        raise ValueError("a client certificate needs its key and a key its certificate: give both cert= and key= "
                         f"(${ENV['cert']}, ${ENV['key']})")
    if bool(sec.user) != bool(sec.password_file):
        raise ValueError("etcd auth needs both user= and password-file= "
                         f"(${ENV['user']}, ${ENV['password-file']})")
    if (sec.cert_file or sec.ca_file) and sec.tls_flag == "0":
        raise ValueError(f"{source['tls_flag']} is 0 but a CA or client certificate is given")
    for name in _FILES:
        path = getattr(sec, name)
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"{source[name]} {path}: not a readable file")
    return sec


def options_query(options: Mapping[str, str | None]) -> str:
    """``?a=1&b=2`` for the options given (None: not given), "" when none."""
    given = {k: v for k, v in options.items() if v is not None}
    return "?" + urlencode(given, safe="/") if given else ""


def split_options(text: str) -> dict[str, str]:
    """``a=1&b=2`` -> {"a": "1", "b": "2"}; ValueError on a repeated option."""
    out: dict[str, str] = {}
    for key, value in parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text)):
        if key in out:
            raise ValueError(f"etcd option {key}= given twice")
        out[key] = value
    return out
