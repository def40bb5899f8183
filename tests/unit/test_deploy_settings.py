"""Multi-host settings: listen ports and ranges, the environment fallbacks of the connector and
the master, and the refusal of a loopback holder address behind a remote master. Real sockets
and a real master process; no vLLM."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdxfer.master import cli as master_cli
from pdxfer.common.ports import PortRange, PortRangeExhausted, PortSpecError, bind_in_range, is_loopback_host, parse_port_spec
from pdxfer.transport import create_transport, transport_options
from pdxfer.transport.base import TransportError
from pdxfer.contracts.connector_config import ADDRESS_ENV, ConnectorConfigError, check_reachable, parse_extra_config

REPO = Path(__file__).resolve().parents[2]


def _listening(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((host, port))
    s.listen()
    return s


def _free_run(n: int) -> int:
    """A first port of ``n`` consecutive ports free right now (bounded search)."""
    for _ in range(50):
        with _listening() as s:
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = [_listening(base + i) for i in range(n)]
        except OSError:
            continue
        for h in held:
            h.close()
        return base
    raise AssertionError(f"no {n} consecutive free ports found")


# ---- port specs -------------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [
    (0, PortRange(0, 0)), ("0", PortRange(0, 0)), (7000, PortRange(7000, 7000)), ("7000", PortRange(7000, 7000)),
    ("17000-17010", PortRange(17000, 17010)), (" 5-5 ", PortRange(5, 5)),
])
def test_port_specs(value, want):
    assert parse_port_spec(value) == want


@pytest.mark.parametrize("value", ["", "abc", "-1", 65536, "70000", "10-5", "0-10", "1-2-3", True, 1.5, None, "5-"])
def test_bad_port_specs_name_the_setting(value):
    with pytest.raises(PortSpecError, match="my_port"):
        parse_port_spec(value, "my_port")


def test_range_takes_the_first_free_port_and_says_when_all_are_taken():
    base = _free_run(3)
    with _listening(base):
        got = bind_in_range(PortRange(base, base + 2), "127.0.0.1", lambda p: _listening(p))
        with got:
            assert got.getsockname()[1] == base + 1
            with _listening(base + 2):
                with pytest.raises(PortRangeExhausted, match=f"every port of listen_port {base}-{base + 2}"):
                    bind_in_range(PortRange(base, base + 2), "127.0.0.1", lambda p: _listening(p))


def test_range_does_not_walk_past_errors_other_than_in_use():
    tried: list[int] = []

    def bind(port: int) -> None:
        tried.append(port)
        raise OSError(99, "Cannot assign requested address")

    with pytest.raises(OSError, match="assign"):
        bind_in_range(PortRange(20000, 20009), "10.255.255.1", bind)
    assert tried == [20000]


def test_tcp_holder_listens_in_its_range():
    base = _free_run(2)
    with _listening(base):
        t = create_transport("tcp", **transport_options("tcp", listen_host="127.0.0.1",
                                                        listen_port=f"{base}-{base + 1}"))
        try:
            assert t.port == base + 1
            assert f'"port":{base + 1}' in t.metadata().decode()
        finally:
            t.close()
        with _listening(base + 1):
            t2 = create_transport("tcp", listen_host="127.0.0.1", listen_port=f"{base}-{base + 1}")
            try:
                with pytest.raises(TransportError, match=f"every port of listen_port {base}-{base + 1}"):
                    _ = t2.port
            finally:
                t2.close()


def test_tcp_holder_rejects_a_bad_port_spec():
    with pytest.raises(ValueError, match="listen_port"):
        create_transport("tcp", listen_port="9-1")


# ---- connector settings -------------------------------------------------------------------------

def test_connector_address_settings_come_from_the_environment():
    env = {"PDXFER_MASTER": "10.0.0.5:7000", "PDXFER_LISTEN_HOST": "0.0.0.0",
           "PDXFER_ADVERTISE_HOST": "10.0.0.7", "PDXFER_LISTEN_PORT": "17000-17007"}
    cfg = parse_extra_config({}, env=env)
    assert (cfg.listen_host, cfg.advertise_host, cfg.listen_port) == ("0.0.0.0", "10.0.0.7", "17000-17007")
    check_reachable(cfg)
    assert parse_extra_config({}, env={**env, "PDXFER_LISTEN_PORT": "17000"}).listen_port == 17000
    # A key in kv_connector_extra_config wins over the environment.
    cfg2 = parse_extra_config({"listen_host": "10.0.0.7", "listen_port": 9000, "advertise_host": "h7"}, env=env)
    assert (cfg2.listen_host, cfg2.advertise_host, cfg2.listen_port) == ("10.0.0.7", "h7", 9000)
    # Defaults when neither says.
    cfg3 = parse_extra_config({"master": "127.0.0.1:1"}, env={})
    assert (cfg3.listen_host, cfg3.advertise_host, cfg3.listen_port) == ("127.0.0.1", None, 0)


@pytest.mark.parametrize("key, value", [("listen_port", "abc"), ("listen_port", "9-1"), ("listen_port", "70000")])
def test_bad_environment_values_name_the_variable(key, value):
    var = ADDRESS_ENV[key]
    with pytest.raises(ConnectorConfigError, match=rf"\${var}: {key}"):
        parse_extra_config({"master": "h:1"}, env={var: value})


@pytest.mark.parametrize("value", ["abc", -3, "1-2-3", True])
def test_bad_listen_port_in_the_config_names_the_key(value):
    with pytest.raises(ConnectorConfigError, match="listen_port"):
        parse_extra_config({"master": "h:1", "listen_port": value}, env={})


@pytest.mark.parametrize("extra, setting", [
    ({"master": "10.0.0.5:7000"}, "PDXFER_LISTEN_HOST"),  # the default 127.0.0.1
    ({"master": "master.pdxfer.svc:7000", "listen_host": "localhost"}, "PDXFER_LISTEN_HOST"),
    ({"master": "10.0.0.5:7000", "listen_host": "0.0.0.0", "advertise_host": "127.0.0.1"}, "PDXFER_ADVERTISE_HOST"),
    ({"master": "10.0.0.5:7000", "listen_host": "0.0.0.0"}, "PDXFER_ADVERTISE_HOST"),
    ({"master": "etcd://127.0.0.1:2379,10.0.0.2:2379/pdxfer/master"}, "PDXFER_LISTEN_HOST"),
    ({"master": "[fd00::5]:7000", "advertise_host": "::1"}, "PDXFER_ADVERTISE_HOST"),
    ({"master": "127.0.0.1:7000", "advertise_host": "0.0.0.0"}, "PDXFER_ADVERTISE_HOST"),
])
def test_loopback_holder_behind_a_remote_master_is_refused(extra, setting):
    cfg = parse_extra_config(extra, env={})
    with pytest.raises(ConnectorConfigError, match=rf"\${setting}"):
        check_reachable(cfg)


@pytest.mark.parametrize("extra", [
    {"master": "127.0.0.1:7000"},
    {"master": "localhost:7000"},
    {"master": "[::1]:7000", "listen_host": "::1"},
    {"master": "etcd://127.0.0.1:2379/pdxfer/master"},
    {"master": "10.0.0.5:7000", "listen_host": "10.0.0.6"},
    {"master": "10.0.0.5:7000", "listen_host": "0.0.0.0", "advertise_host": "10.0.0.6"},
    {"master": "10.0.0.5:7000", "transport": "nixl"},  # UCX finds its own addresses
])
def test_reachable_or_single_host_settings_pass(extra):
    check_reachable(parse_extra_config(extra, env={}))


def test_loopback_names():
    assert all(map(is_loopback_host, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback_host, ["10.0.0.1", "0.0.0.0", "fd00::1", "master", "128.0.0.1"]))


# ---- the master's flags ----------------------------------------------------------------------

def _master_args(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    args = master_cli.build_parser().parse_args(argv)
    master_cli.apply_env_fallbacks(args, env)
    return args


def test_master_flags_fall_back_to_the_environment():
    env = {"PDXFER_MASTER_LISTEN_HOST": "0.0.0.0", "PDXFER_MASTER_LISTEN_PORT": "7000-7002",
           "PDXFER_MASTER_HTTP_HOST": "127.0.0.1", "PDXFER_MASTER_HTTP_PORT": "-1",
           "PDXFER_MASTER_ADVERTISE": "10.0.0.5"}
    a = _master_args([], env)
    assert (a.host, a.port, a.http_host, a.http_port, a.advertise) == \
        ("0.0.0.0", PortRange(7000, 7002), "127.0.0.1", -1, "10.0.0.5")
    assert master_cli._advertise_for(a.advertise, 7001) == "10.0.0.5:7001"
    assert master_cli._advertise_for("[fd00::5]:7000", 7001) == "[fd00::5]:7000"
    b = _master_args(["--host", "10.0.0.9", "--port", "7100", "--http-port", "7101"], env)
    assert (b.host, b.port, b.http_port) == ("10.0.0.9", PortRange(7100, 7100), 7101)
    c = _master_args([], {})
    assert (c.host, c.port, c.http_host, c.http_port, c.advertise) == ("127.0.0.1", PortRange(0, 0), None, 0, None)


@pytest.mark.parametrize("argv, env, needle", [
    ([], {"PDXFER_MASTER_LISTEN_PORT": "seven"}, r"\$PDXFER_MASTER_LISTEN_PORT must be"),
    (["--port", "9-1"], {}, "--port range '9-1' is empty"),
    ([], {"PDXFER_MASTER_HTTP_PORT": "70000"}, r"\$PDXFER_MASTER_HTTP_PORT must be"),
    (["--http-port", "x"], {}, "--http-port must be"),
    ([], {"PDXFER_MASTER_ADVERTISE": "10.0.0.5"}, r"\$PDXFER_MASTER_ADVERTISE '10.0.0.5' has no port"),
])
def test_bad_master_settings_exit_naming_them(argv, env, needle):
    with pytest.raises(SystemExit, match=needle):
        _master_args(argv, env)


@pytest.mark.timeout(60)
def test_master_process_takes_the_next_port_of_its_range(tmp_path):
    base = _free_run(2)
    port_file = tmp_path / "port"
    env = {"PYTHONPATH": str(REPO), "PDXFER_MASTER_LISTEN_PORT": f"{base}-{base + 1}",
           "PDXFER_MASTER_HTTP_PORT": "-1", "PATH": "/usr/bin:/bin"}
    with _listening(base):
        p = subprocess.Popen([sys.executable, "-m", "pdxfer.master.service", "--port-file", str(port_file)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                assert p.poll() is None, p.stderr.read()
                assert time.monotonic() < deadline, "no port file"
                time.sleep(0.05)
            assert port_file.read_text().split()[0] == str(base + 1)
        finally:
            p.terminate()
            p.wait(10)
        with _listening(base + 1):
            r = subprocess.run([sys.executable, "-m", "pdxfer.master.service"], env=env, capture_output=True,
                               text=True, timeout=30)
        assert r.returncode != 0
        assert f"every port of $PDXFER_MASTER_LISTEN_PORT {base}-{base + 1} on 127.0.0.1 is in use" in r.stderr
    # The HTTP port is fixed, not a range: taken, the master says which one.
    with _listening(base + 1):
        r = subprocess.run([sys.executable, "-m", "pdxfer.master.service", "--port", "0", "--http-port",
                            str(base + 1)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and f"HTTP port {base + 1} on 127.0.0.1 is in use" in r.stderr, r.stderr[-500:]
