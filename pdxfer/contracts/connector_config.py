"""``kv_connector_extra_config`` of the pdxfer connector: parsing with errors that name the key.

No vLLM import here: the launcher and tests build and validate configs without loading vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping
from urllib.parse import urlsplit

from pdxfer.common.ports import PortSpecError, is_loopback_host, is_wildcard_host, parse_port_spec
from pdxfer.common.secret_file import SecretFileError, read_secret_file
from pdxfer.transport import KINDS, kind_spec

# The launcher exports the address of the master it started; a config without "master" uses it.
MASTER_ENV = "PDXFER_MASTER"
MASTER_TOKEN_FILE_ENV = "PDXFER_MASTER_TOKEN_FILE"
# The instance's own OpenAI HTTP base URL, announced to the master for routers; a launcher that
# starts several instances sets it per instance.
SERVE_URL_ENV = "PDXFER_SERVE_URL"
# Test-only hooks (lock-expiry and slow-read faults) are read only when this names a directory.
TEST_HOOKS_ENV = "PDXFER_TEST_HOOKS_DIR"
# Where this instance's holder listens and what readers are told, when the config leaves them out
# (a pod's IP comes in through PDXFER_ADVERTISE_HOST from the downward API).
ADDRESS_ENV = {"listen_host": "PDXFER_LISTEN_HOST", "advertise_host": "PDXFER_ADVERTISE_HOST",
               "listen_port": "PDXFER_LISTEN_PORT"}

TRANSPORTS = KINDS  # the transport registry's names


class ConnectorConfigError(ValueError):
    """A kv_connector_extra_config value pdxfer cannot use; the message names the key."""


@dataclass(frozen=True)
class ConnectorConfig:
    master: str
    master_token_file: str | None = None
    transport: str = "tcp"
    chunk_tokens: int = 256
    lookup_timeout_s: float = 0.5  # bounded master wait on the scheduler's hot path
    master_timeout_s: float = 2.0  # background master calls (unpublish, re-publish, lease)
    # How long a finishing request waits, at most, for its publish to reach the master. 0: never
    # on the prefill's path; a decode that got the publish hint (see publish_hint_wait_s) waits
    # instead. Set it (e.g. 0.05) only behind a proxy that drops kv_transfer_params.
    publish_wait_s: float = 0.0
    # A decode whose request carries the prefill's publish hint (kv_transfer_params, forwarded
    # by the proxy) waits at most this long for those chunks to reach the master before it
    # computes without them: the publish no longer races the decode's lookup.
    publish_hint_wait_s: float = 0.25
    # A holder publishes a finished request only once every TP rank saw the device complete the
    # KV writes of the last step that computed it; waiting longer than this (off the step path,
    # on the publisher thread), it drops that publish with a warning (publishes_unfenced).
    publish_fence_wait_s: float = 2.0
    lock_ttl_s: float = 10.0
    retention_s: float = 60.0  # how long a holder keeps published chunks after the request ends
    max_held_fraction: float = 0.5  # cap on the share of KV blocks held for readers
    load_timeout_s: float = 10.0  # a read still pending after this is cancelled -> recompute
    # A read may take at most this floor plus 4x what its bytes take at the holder's observed
    # bandwidth (never more than load_timeout_s): a frozen holder costs well under a second.
    read_timeout_floor_s: float = 0.5
    # First contact with a holder (a NIXL agent handshake takes ~0.2 s here): a load waiting for
    # a connection longer than this is recomputed (the connect itself goes on for later loads).
    connect_timeout_s: float = 1.0
    # Reader-side staging for holders whose blocks differ (READ whole blocks, then scatter by
    # token range), in MiB; 0 turns such holders away (their chunks are recomputed). None
    # ("auto"): from the model, one max-length load plus headroom, at most staging_max_mib.
    # Loads larger than the free staging stream through it in pieces.
    staging_mib: int | None = None
    staging_max_mib: int = 512
    lease_ttl_s: float = 10.0
    listen_host: str = "127.0.0.1"
    # 0: the OS picks; N; or "N-M", tried in order (one port per TP rank on the host)
    listen_port: int | str = 0
    advertise_host: str | None = None
    model_id: str | None = None  # namespace model identity; default: vLLM's model path/name
    log_level: str | None = None
    # A kv_consumer publishes what it holds when a request finishes (its prompt and the tokens it
    # generated), like a prefill, so the next turn of a conversation finds it there. False: a
    # kv_consumer only reads (it neither registers with the master nor holds blocks).
    publish_as_decode: bool = True
    # This instance's OpenAI HTTP base URL ("http://10.0.0.5:8100"), carried in its registration
    # so a router can send requests to whichever instance holds a prompt. None: not announced.
    serve_url: str | None = None
    # Load only the prefix of a hit that is expected to arrive sooner than this instance would
    # compute it, from the loads and prefill steps it measured (reader_benefit.py); false: load
    # every usable hit. A shorter choice is taken only when it saves more than the margin.
    load_benefit: bool = False
    load_benefit_margin: float = 0.25
    # Host-memory tier, in MiB of pinned host memory per TP rank (0: off; None, from "auto": a
    # share of the host's available memory, host_pool.auto_host_tier_mib). Published chunks are
    # copied there when their request finishes; when their GPU blocks are released (retention
    # over, cap pressure) the master's entry moves to the host copy instead of disappearing.
    host_tier_mib: int | None = 0

    @property
    def staging_enabled(self) -> bool:
        """Whether readers convert through staging (else holders needing it are turned away)."""
        return self.staging_mib != 0 and (self.staging_mib is not None or self.staging_max_mib > 0)

    @property
    def token(self) -> str | None:
        if not self.master_token_file:
            return None
        try:
            return read_secret_file(self.master_token_file, "master_token_file")
        except SecretFileError as exc:
            raise ConnectorConfigError(str(exc)) from exc


_FLOATS = {"lookup_timeout_s", "master_timeout_s", "lock_ttl_s", "retention_s", "load_timeout_s",
           "read_timeout_floor_s", "connect_timeout_s", "lease_ttl_s", "publish_fence_wait_s"}
_NONNEG_FLOATS = {"publish_wait_s", "publish_hint_wait_s",  # 0 turns the wait off
                  "load_benefit_margin"}  # 0: any expected saving counts
# Keys vLLM's own connectors read from the same dict; harmless to carry, so not an error.
_IGNORED = {"backends"}


def known_keys() -> list[str]:
    return sorted(f.name for f in fields(ConnectorConfig))


def parse_extra_config(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; unknown keys and bad values raise with their name."""
    env = os.environ if env is None else env
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(known_keys()) - _IGNORED)
    if unknown:
        raise ConnectorConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; "
                                   f"known: {known_keys()}")
    for k in _IGNORED:
        extra.pop(k, None)
    if not extra.get("master"):
        if env.get(MASTER_ENV):
            extra["master"] = env[MASTER_ENV]
        else:
            raise ConnectorConfigError(f"kv_connector_extra_config needs 'master' (\"host:port\" or "
                                       f"\"etcd://host:port/prefix\"), or set ${MASTER_ENV}")
    if not extra.get("master_token_file") and env.get(MASTER_TOKEN_FILE_ENV):
        extra["master_token_file"] = env[MASTER_TOKEN_FILE_ENV]
    if extra.get("serve_url") is None and env.get(SERVE_URL_ENV):
        extra["serve_url"] = env[SERVE_URL_ENV]
    out: dict[str, Any] = {}
    for key, value in extra.items():
        out[key] = _check(key, value)
    for key, var in ADDRESS_ENV.items():
        if out.get(key) is None and env.get(var, "").strip():
            try:
                out[key] = _check(key, env[var].strip())
            except ConnectorConfigError as exc:
                raise ConnectorConfigError(f"${var}: {exc}") from None
    cfg = ConnectorConfig(**out)
    if cfg.transport not in TRANSPORTS:
        raise ConnectorConfigError(f"transport {cfg.transport!r} is not one of {list(TRANSPORTS)}")
    if not 0.0 < cfg.max_held_fraction <= 1.0:
        raise ConnectorConfigError(f"max_held_fraction must be in (0, 1], got {cfg.max_held_fraction}")
    if cfg.lock_ttl_s <= cfg.lookup_timeout_s:
        raise ConnectorConfigError(f"lock_ttl_s ({cfg.lock_ttl_s}) must exceed lookup_timeout_s "
                                   f"({cfg.lookup_timeout_s})")
    return cfg


def _master_hosts(master: str) -> list[str]:
    """The hosts of a master address: "host:port", or "etcd://host:port[,host:port]/prefix"."""
    rest = master.split("://", 1)[1] if "://" in master else master
    hosts = []
    for hp in rest.split("/", 1)[0].split(","):
        host = hp.rsplit(":", 1)[0] if hp.count(":") == 1 or hp.startswith("[") else hp
        hosts.append(host.strip("[]"))
    return [h for h in hosts if h]


def check_reachable(cfg: ConnectorConfig) -> None:
    """Refuse a holder address other hosts cannot reach while the master is on another host: every
    read of this instance's KV would fail and quietly recompute. Checked when the worker starts
    its transport (host names are not resolved: only "localhost" counts as loopback)."""
    if "advertise_host" not in kind_spec(cfg.transport).settings:
        return  # the transport finds its own addresses (NIXL/UCX)
    if cfg.advertise_host is not None and is_wildcard_host(cfg.advertise_host):
        raise ConnectorConfigError(f"advertise_host {cfg.advertise_host!r} is a wildcard; give the address "
                                   f"readers connect to (${ADDRESS_ENV['advertise_host']})")
    remote = [h for h in _master_hosts(cfg.master) if not is_loopback_host(h)]
    if not remote:
        return
    if cfg.advertise_host is not None:
        if is_loopback_host(cfg.advertise_host):
            raise ConnectorConfigError(
                f"advertise_host {cfg.advertise_host!r} is a loopback address but the master ({cfg.master}) "
                f"is not: readers on other hosts could not reach this instance's KV. Set advertise_host "
                f"(or ${ADDRESS_ENV['advertise_host']}) to an address of this host they can reach")
        return
    if is_wildcard_host(cfg.listen_host):
        raise ConnectorConfigError(
            f"listen_host {cfg.listen_host!r} with no advertise_host while the master ({cfg.master}) is on "
            f"another host: say which address readers connect to with advertise_host "
            f"(or ${ADDRESS_ENV['advertise_host']}, e.g. the pod IP)")
    if is_loopback_host(cfg.listen_host):
        raise ConnectorConfigError(
            f"listen_host {cfg.listen_host!r} is a loopback address (the default is 127.0.0.1) but the master "
            f"({cfg.master}) is not: readers on other hosts could not reach this instance's KV. Set "
            f"listen_host (or ${ADDRESS_ENV['listen_host']}) to this host's address, or to 0.0.0.0 with "
            f"advertise_host (${ADDRESS_ENV['advertise_host']})")


def _check(key: str, value: Any) -> Any:
    if key == "chunk_tokens":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConnectorConfigError(f"chunk_tokens must be a positive int, got {value!r}")
        return value
    if key == "staging_mib":
        if value is None or value == "auto":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConnectorConfigError(f"staging_mib must be an int >= 0 or \"auto\", got {value!r}")
        return value
    if key == "host_tier_mib" and value == "auto":
        return None
    if key in ("staging_max_mib", "host_tier_mib"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            also = ' or "auto"' if key == "host_tier_mib" else ""
            raise ConnectorConfigError(f"{key} must be an int >= 0{also}, got {value!r}")
        return value
    if key == "listen_port":
        try:
            spec = parse_port_spec(value)
        except PortSpecError as exc:
            raise ConnectorConfigError(str(exc)) from None
        return spec.first if spec.first == spec.last else str(spec)
    if key in _NONNEG_FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConnectorConfigError(f"{key} must be a number >= 0, got {value!r}")
        return float(value)
    if key in _FLOATS or key == "max_held_fraction":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConnectorConfigError(f"{key} must be a positive number, got {value!r}")
        return float(value)
    if key in ("publish_as_decode", "load_benefit"):
        if not isinstance(value, bool):
            raise ConnectorConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if key == "serve_url":
        return _serve_url(value)
    if value is None and key in ("master_token_file", "advertise_host", "model_id", "log_level"):
        return None
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _serve_url(value: Any) -> str | None:
    """An http(s) base URL with a host, without a trailing slash (routers append paths to it)."""
    if value is None:
        return None
    where = f"serve_url (or ${SERVE_URL_ENV})"
    if not isinstance(value, str) or not value.strip():
        raise ConnectorConfigError(f"{where} must be an http(s) base URL such as \"http://10.0.0.5:8100\", "
                                   f"got {value!r}")
    url = urlsplit(value.strip())
    try:
        url.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError as exc:
        raise ConnectorConfigError(f"{where} {value!r} has a bad port: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
        raise ConnectorConfigError(f"{where} must be an http(s) base URL with a host such as "
                                   f"\"http://10.0.0.5:8100\", got {value!r}")
    return value.strip().rstrip("/")
