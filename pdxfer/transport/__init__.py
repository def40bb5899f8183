"""Transports: one interface (base.py), one run check (runs.py), one folder per transport, and this
registry, the only place that knows which transports exist.

Every caller (connector, probe, bench, tests) goes through the registry: ``KINDS`` for the names,
``create_transport`` to build one, ``transport_options`` to turn the settings a caller has into
the options a kind takes, and ``unavailable_reason`` to ask whether a kind can run here. A new
transport is a new folder under pdxfer/transport/ plus one ``TransportKind`` entry in ``REGISTRY``.

Nothing here imports a transport's module (or its optional dependency, e.g. NIXL) until asked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pdxfer.transport.base import Transport, TransportError

# Settings callers hand to ``transport_options``; each kind takes the subset it names.
#   listen_host     address a holder listens on (connector config, probe --host, tests)
#   listen_port     its port: 0 (the OS picks), N, or a range "N-M" tried in order (connector config)
#   advertise_host  address readers are told to connect to (connector config, probe --advertise)
#   connections     parallel connections per peer (probe --tcp-connections)
SETTINGS = frozenset({"listen_host", "listen_port", "advertise_host", "connections"})


@dataclass(frozen=True)
class TransportKind:
    name: str
    target: str  # "module:Class" of the Transport implementation
    summary: str
    settings: frozenset[str] = frozenset()  # which of SETTINGS this kind takes, as keyword options
    check: str | None = None  # "module:function" -> None or why the kind cannot run here
    test_marker: str | None = None  # pytest marker of the tests that need this kind's dependency


REGISTRY: dict[str, TransportKind] = {k.name: k for k in (
    TransportKind("tcp", "pdxfer.transport.tcp.transport:TcpTransport",
                  "pdxfer's own TCP transport (host memory; GPU memory through a pinned bounce buffer; "
                  "clusters without RDMA)",
                  settings=frozenset({"listen_host", "listen_port", "advertise_host", "connections"})),
    TransportKind("nixl", "pdxfer.transport.nixl.transport:NixlTransport",
                  "NIXL agent with the UCX backend (DRAM here; VRAM and RDMA where UCX has them)",
                  check="pdxfer.transport.nixl.env:unavailable_reason", test_marker="nixl"),
)}
KINDS: tuple[str, ...] = tuple(REGISTRY)

_checked: dict[str, str | None] = {}


def kind_spec(kind: str) -> TransportKind:
    """The registry entry of ``kind``; ValueError naming it and the known kinds otherwise."""
    try:
        return REGISTRY[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown transport {kind!r}; known: {', '.join(KINDS)}") from None


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def create_transport(kind: str, **options: Any) -> Transport:
    """Build a transport by name; its module (and optional dependency) is imported only now."""
    return _load(kind_spec(kind).target)(**options)


def transport_options(kind: str, **settings: Any) -> dict[str, Any]:
    """The keyword options ``kind`` takes out of ``settings`` (None values left out, so the
    transport's own default applies). A setting outside SETTINGS is a ValueError naming it."""
    spec = kind_spec(kind)
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise ValueError(f"unknown transport setting(s) {unknown}; known: {sorted(SETTINGS)}")
    return {k: v for k, v in settings.items() if k in spec.settings and v is not None}


def unavailable_reason(kind: str) -> str | None:
    """None if ``kind`` can run in this process, else why not (checked once per process)."""
    spec = kind_spec(kind)
    if kind not in _checked:
        try:
            _load(spec.target)
            _checked[kind] = _load(spec.check)() if spec.check else None
        except Exception as exc:  # noqa: BLE001 - any failure to load means "not available here"
            _checked[kind] = f"transport {kind!r} does not load here: {exc!r}"
    return _checked[kind]


def available_kinds() -> dict[str, str | None]:
    """kind -> None if it can run here, else why not; every registered kind."""
    return {k: unavailable_reason(k) for k in KINDS}


__all__ = ["KINDS", "REGISTRY", "SETTINGS", "Transport", "TransportError", "TransportKind", "available_kinds",
           "create_transport", "kind_spec", "transport_options", "unavailable_reason"]
