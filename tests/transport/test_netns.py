"""Holder and reader in two network namespaces joined by a veth pair: the transport must work
over a real interface and address, not only 127.0.0.1. Needs root and a working ``ip netns``."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from .conftest import MiB, spawn_reader, start_holder, stop, transport_options

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 `ip` command not found"
    probe = f"pdxprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` does not work here: {getattr(exc, 'stderr', exc)}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@pytest.fixture
def veth_pair():
    """Two fresh namespaces joined by veth; addresses (10.x.y.1/.2 /30) exist only inside them."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"pdxa{tag}", f"pdxb{tag}"
    dev_a, dev_b = f"vpa{tag}", f"vpb{tag}"
    x, y = secrets.randbelow(250) + 1, secrets.randbelow(63) * 4
    addr_a, addr_b = f"10.{x}.{y}.1", f"10.{x}.{y}.2"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield (ns_a, addr_a), (ns_b, addr_b)
    finally:
        for ns in made:  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", dev_a], capture_output=True, timeout=10)


def test_read_across_network_namespaces(kind, veth_pair):
    (ns_a, addr_a), (ns_b, addr_b) = veth_pair
    hold_opts = transport_options(kind, addr_a)
    read_opts = transport_options(kind, addr_b)
    holder = start_holder(kind, sizes=(64 * MiB,), opts=hold_opts, prefix_cmd=["ip", "netns", "exec", ns_a])
    try:
        if kind == "tcp":
            assert f'"host":"{addr_a}"' in holder.meta.decode()
        reader = spawn_reader(kind, holder, 32 << 10, 1024, iters=2, opts=read_opts,
                              prefix_cmd=["ip", "netns", "exec", ns_b])
        try:
            out, err = reader.communicate(timeout=120)
        finally:
            stop(reader)
        assert reader.returncode == 0, f"reader in {ns_b}: {out[-500:]} {err[-2000:]}"
        assert out.count("OK ") == 2
    finally:
        stop(holder.proc)
