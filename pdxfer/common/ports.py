"""Listen ports a firewall rule can name: ``0`` (the OS picks), ``N`` or a range ``"N-M"``.

One parser for every server part (the master's flags, the connector's ``listen_port``, the TCP
transport), so the same spelling means the same thing everywhere, and one bind loop that tries a
range in order and says plainly when all of it is taken.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


class PortSpecError(ValueError):
    """A port setting that is not 0, a port 1-65535 or a range "N-M" of them."""


class PortRangeExhausted(OSError):
    """Every port of a listen range was in use."""


@dataclass(frozen=True)
class PortRange:
    first: int
    last: int

    @property
    def any(self) -> bool:
        """Port 0: the OS chooses."""
        return self.first == 0

    def ports(self) -> range:
        return range(self.first, self.last + 1)

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


_HELP = '0 (any free port), a port 1-65535, or a range "N-M" with 1 <= N <= M <= 65535'


def _port(text: str, what: str, allow_zero: bool) -> int:
    try:
        n = int(text.strip(), 10)
    except ValueError:
        raise PortSpecError(f"{what} must be {_HELP}, got {text!r}") from None
    if not (0 if allow_zero else 1) <= n <= 65535:
        raise PortSpecError(f"{what} must be {_HELP}, got {text!r}")
    return n


def parse_port_spec(value: object, what: str = "listen_port") -> PortRange:
    """``value`` (an int, or a string "N" / "N-M") as a :class:`PortRange`; ``what`` names the
    setting in the error."""
    if isinstance(value, PortRange):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PortSpecError(f"{what} must be {_HELP}, got {value!r}")
    if isinstance(value, int):
        n = _port(str(value), what, allow_zero=True)
        return PortRange(n, n)
    first, sep, last = value.partition("-")
    if not sep:
        n = _port(value, what, allow_zero=True)
        return PortRange(n, n)
    lo, hi = _port(first, what, allow_zero=False), _port(last, what, allow_zero=False)
    if lo > hi:
        raise PortSpecError(f"{what} range {value!r} is empty: {lo} > {hi}")
    return PortRange(lo, hi)


def bind_in_range(spec: PortRange, host: str, bind: Callable[[int], T], what: str = "listen_port") -> T:
    """``bind(port)`` for each port of ``spec`` in order until one is free; the first result.

    Only "address in use" moves on to the next port; any other error (no such address, no
    permission) is the same for every port and is raised at once. All taken:
    :class:`PortRangeExhausted` naming the range and the setting to widen.
    """
    for port in spec.ports():
        try:
            return bind(port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or spec.any:
                raise
    taken = f"port {spec} ({what})" if spec.first == spec.last else f"every port of {what} {spec}"
    raise PortRangeExhausted(errno.EADDRINUSE, f"{taken} on {host or '*'} is in use; free one or give a "
                                               f"wider range N-M (one port per TP rank on a host)")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or a name, not resolved) can only be reached from this host."""
    h = host.strip().strip("[]").lower()
    if h in ("localhost", "ip6-localhost", "ip6-loopback") or h.endswith(".localhost"):
        return True
    try:
        packed = socket.inet_pton(socket.AF_INET, h)
        return packed[0] == 127
    except OSError:
        pass
    try:
        packed6 = socket.inet_pton(socket.AF_INET6, h)
    except OSError:
        return False
    if packed6 == bytes(15) + b"\x01":
        return True
    return packed6[:12] == bytes(10) + b"\xff\xff" and packed6[12] == 127  # ::ffff:127.x.y.z


def is_wildcard_host(host: str) -> bool:
    return host.strip().strip("[]") in ("", "0.0.0.0", "::")


__all__ = ["PortRange", "PortRangeExhausted", "PortSpecError", "bind_in_range", "is_loopback_host",
           "is_wildcard_host", "parse_port_spec"]
