"""Open file descriptors of processes, counted by kind, so a soak that sees fds grow can say which.

Kinds: ``file``, ``pipe``, ``anon_inode:<what>`` (eventfd, eventpoll, ...), ``socket:unix``,
``socket:tcp-listen``, ``socket:tcp-><group>`` (a connection this process opened to a port that
``<group>`` listens on), ``socket:tcp<-<group>`` (one it accepted from ``<group>``), with
``other`` for a peer in none of the groups (the soak's own client, a scraper) and
``socket:other`` for anything else (netlink, UDP, ...). A TCP socket is placed by its ports, read
from ``/proc/net/tcp`` and ``tcp6`` of this host.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

_LISTEN = "0A"  # TCP state code in /proc/net/tcp


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue  # gone while we looked
    return out


def fd_targets(pids: Iterable[int]) -> list[str]:
    """What every open fd of ``pids`` points at (``socket:[123]``, ``pipe:[4]``, a path, ...)."""
    out = []
    for pid in pids:
        d = f"/proc/{pid}/fd"
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            try:
                out.append(os.readlink(f"{d}/{n}"))
            except OSError:
                continue  # closed meanwhile
    return out


def tcp_table() -> dict[str, tuple[int, int, bool]]:
    """Socket inode -> (local port, remote port, listening) for every TCP socket of this host."""
    table: dict[str, tuple[int, int, bool]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10:
                continue
            table[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), f[3] == _LISTEN)
    return table


def unix_inodes() -> set[str]:
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {f[6] for f in (line.split() for line in lines) if len(f) >= 7}


def kinds_by_group(targets: Mapping[str, list[str]]) -> dict[str, dict[str, int]]:
    """Per group (name -> its fds' targets, from :func:`fd_targets`): count of each kind."""
    tcp = tcp_table()
    unix = unix_inodes()
    listeners: dict[int, str] = {}  # listening port -> group
    client_ports: dict[int, str] = {}  # local port of a non-listening TCP socket -> group
    for group, ts in targets.items():
        for t in ts:
            s = tcp.get(t[8:-1]) if t.startswith("socket:[") else None
            if s is not None:
                (listeners if s[2] else client_ports)[s[0]] = group
    out: dict[str, dict[str, int]] = {}
    for group, ts in targets.items():
        c: Counter[str] = Counter()
        for t in ts:
            c[_kind(t, group, tcp, unix, listeners, client_ports)] += 1
        out[group] = dict(sorted(c.items()))
    return out


def _kind(t: str, group: str, tcp: Mapping[str, tuple[int, int, bool]], unix: set[str],
          listeners: Mapping[int, str], client_ports: Mapping[int, str]) -> str:
    if t.startswith("/"):
        return "file"
    if t.startswith("pipe:"):
        return "pipe"
    if t.startswith("anon_inode:"):
        return t
    if not t.startswith("socket:["):
        return "other"
    inode = t[8:-1]
    if inode in unix:
        return "socket:unix"
    s = tcp.get(inode)
    if s is None:
        return "socket:other"
    local, remote, listening = s
    if listening:
        return "socket:tcp-listen"
    # An accepted connection has the listener's port as its local port; the peer is whoever
    # owns the other end's port. Otherwise this process dialled a port someone listens on.
    if listeners.get(local) == group:
        return f"socket:tcp<-{client_ports.get(remote, 'other')}"
    return f"socket:tcp->{listeners.get(remote, 'other')}"
