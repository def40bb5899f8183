"""Transports: one interface (base.py), several implementations, chosen by name."""

from __future__ import annotations

from typing import Any

from pdxfer.transport.base import Transport, TransportError

KINDS = ("tcp", "nixl")


def create_transport(kind: str, **options: Any) -> Transport:
    """Build a transport by name; NIXL is imported only when asked for (it is an optional extra)."""
    if kind == "tcp":
        from pdxfer.transport.tcp import TcpTransport

        return TcpTransport(**options)
    if kind == "nixl":
        from pdxfer.transport.nixl import NixlTransport

        return NixlTransport(**options)
    raise ValueError(f"unknown transport {kind!r}; known: {', '.join(KINDS)}")


__all__ = ["KINDS", "Transport", "TransportError", "create_transport"]
