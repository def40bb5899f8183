"""TLS on the master's wire and HTTP ports, with real pdxfer-master processes and certificates
made here (trustme): lookups and publishes over TLS, the token still checked, client certificates
required, and every mismatch (plain vs TLS, untrusted CA, no client certificate, wrong server
name) refused within the client's time budget with a message naming what was refused."""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
from dataclasses import dataclass

import pytest

trustme = pytest.importorskip("trustme", reason="no trustme (certificates for the TLS tests; "
                              "scripts/setup.sh installs it)")

from pdxfer.master import MasterAuthError, MasterClient, MasterUnavailable, start_local_master  # noqa: E402
from pdxfer.master.wire.tls import MasterTlsError  # noqa: E402

from .conftest import keys_for, node_info  # noqa: E402

BUDGET = 2.0  # each refusal must come within the client's timeout, plus slack for a loaded machine


@dataclass(frozen=True)
class Pki:
    ca: str
    cert: str  # the master's: names 127.0.0.1 and localhost
    key: str
    localhost_cert: str  # names only "localhost": wrong for a client dialling 127.0.0.1
    localhost_key: str
    client_cert: str
    client_key: str
    other_ca: str  # trusts nothing here
    other_client_cert: str  # signed by other_ca
    other_client_key: str


@pytest.fixture
def pki(tmp_path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()

    def write(name: str, data: bytes) -> str:
        path = d / name
        path.write_bytes(data)
        os.chmod(path, 0o600)
        return str(path)

    def leaf(ca, stem: str, *names: str) -> tuple[str, str]:
        c = ca.issue_cert(*names)
        return (write(f"{stem}.pem", b"".join(x.bytes() for x in c.cert_chain_pems)),
                write(f"{stem}.key", c.private_key_pem.bytes()))

    ca, other = trustme.CA(), trustme.CA()
    cert, key = leaf(ca, "master", "127.0.0.1", "localhost")
    lh_cert, lh_key = leaf(ca, "localhost", "localhost")
    cc, ck = leaf(ca, "client", "pdxfer-client")
    occ, ock = leaf(other, "other-client", "pdxfer-client")
    return Pki(write("ca.pem", ca.cert_pem.bytes()), cert, key, lh_cert, lh_key, cc, ck,
               write("other-ca.pem", other.cert_pem.bytes()), occ, ock)


def tls_args(pki: Pki, client_ca: bool = False) -> tuple[str, ...]:
    return ("--tls-cert", pki.cert, "--tls-key", pki.key) + (("--tls-client-ca", pki.ca) if client_ca else ())


@pytest.fixture
def trusting(monkeypatch, pki):
    """The test process's clients (also the one start_local_master waits with) trust the test CA
    and present the client certificate: the environment fallbacks."""
    monkeypatch.setenv("PDXFER_MASTER_CA_FILE", pki.ca)
    monkeypatch.setenv("PDXFER_MASTER_CERT_FILE", pki.client_cert)
    monkeypatch.setenv("PDXFER_MASTER_KEY_FILE", pki.client_key)


def _refused(call, budget: float = BUDGET) -> MasterUnavailable | MasterAuthError:
    t0 = time.monotonic()
    with pytest.raises((MasterUnavailable, MasterAuthError)) as info:
        call()
    took = time.monotonic() - t0
    assert took < budget + 1.0, f"refusal took {took:.1f}s"
    return info.value


def test_tls_client_looks_up_and_publishes_with_token_and_client_cert(masters, pki, trusting):
    m = masters.start(token="tok", extra_args=tls_args(pki, client_ca=True))
    c = masters.client(m.address, token="tok")
    assert c.tls is not None and c.tls.ca_file == pki.ca  # from $PDXFER_MASTER_CA_FILE
    c.register_node(node_info("holder"))
    keys = keys_for("tls", 6)
    assert c.publish("holder", [(k, [i]) for i, k in enumerate(keys)]) == 6
    res = c.lookup_and_lock(keys, reader="decode")
    assert res.hit_chunks == 6
    assert [(loc.node_id, loc.block_ids) for loc in res.locations] == [("holder", [i]) for i in range(6)]
    assert res.nodes["holder"].transport_metadata == b"meta-holder"
    c.release(res.lock_id)
    # The token is still checked over TLS: the handshake alone does not authenticate.
    wrong = masters.client(m.address, token="nope")
    assert isinstance(_refused(lambda: wrong.stats()), MasterAuthError)
    none = masters.client(m.address)
    assert "token" in str(_refused(lambda: none.stats()))


def test_plain_client_against_tls_master_is_told_within_its_budget(masters, pki, trusting, monkeypatch):
    m = masters.start(token="tok", extra_args=tls_args(pki))
    tls_m = masters.start(extra_args=tls_args(pki))  # no token: the first frame is a request
    for var in ("PDXFER_MASTER_CA_FILE", "PDXFER_MASTER_CERT_FILE", "PDXFER_MASTER_KEY_FILE"):
        monkeypatch.delenv(var)
    for addr, token in ((m.address, "tok"), (tls_m.address, None)):
        plain = masters.client(addr, token=token, timeout_s=1.0)
        assert plain.tls is None
        err = _refused(lambda: plain.stats(), 1.0)
        assert "TLS" in str(err) and "PDXFER_MASTER_CA_FILE" in str(err), err


def test_tls_client_against_plain_master_is_told_within_its_budget(masters, pki):
    m = masters.start(token="tok")
    c = MasterClient(m.address, token="tok", timeout_s=1.0, ca_file=pki.ca)
    masters.clients.append(c)
    err = _refused(lambda: c.stats(), 1.0)
    assert isinstance(err, MasterTlsError)
    assert "does not serve TLS" in str(err), err


def test_untrusted_ca_and_missing_client_cert_are_named(masters, pki, trusting):
    m = masters.start(extra_args=tls_args(pki, client_ca=True))
    untrusted = MasterClient(m.address, timeout_s=1.0, ca_file=pki.other_ca, cert_file=pki.client_cert,
                             key_file=pki.client_key)
    no_cert = MasterClient(m.address, timeout_s=1.0, ca_file=pki.ca, cert_file="", key_file="")
    foreign = MasterClient(m.address, timeout_s=1.0, ca_file=pki.ca, cert_file=pki.other_client_cert,
                           key_file=pki.other_client_key)
    masters.clients += [untrusted, no_cert, foreign]
    err = _refused(lambda: untrusted.stats())
    assert isinstance(err, MasterTlsError) and "not trusted" in str(err) and pki.other_ca in str(err), err
    assert no_cert.tls is not None and no_cert.tls.cert_file is None
    err = _refused(lambda: no_cert.stats())
    assert isinstance(err, MasterAuthError) and "TLS client certificate required" in str(err), err
    err = _refused(lambda: foreign.stats())
    assert isinstance(err, MasterTlsError) and pki.other_client_cert in str(err) and "did not accept" in str(err), err
    # The master is still serving the client that is set up right.
    assert masters.client(m.address).ping()


def test_server_name_is_verified(masters, pki, trusting):
    # This certificate names only "localhost", and start_local_master dials 127.0.0.1: it waits
    # with a client told to expect "localhost". The master takes its files from the environment.
    os.environ["PDXFER_MASTER_SERVER_NAME"] = "localhost"
    try:
        m = start_local_master(workdir=masters.workdir, env={"PDXFER_MASTER_TLS_CERT": pki.localhost_cert,
                                                             "PDXFER_MASTER_TLS_KEY": pki.localhost_key})
    finally:
        del os.environ["PDXFER_MASTER_SERVER_NAME"]
    masters.started.append(m)
    wrong_name = masters.client(m.address, timeout_s=1.0)
    err = _refused(lambda: wrong_name.stats(), 1.0)
    assert isinstance(err, MasterTlsError) and "not trusted" in str(err) and "127.0.0.1" in str(err), err
    right = MasterClient(m.address, timeout_s=1.0, server_name="localhost")
    masters.clients.append(right)
    assert right.ping()


def test_http_port_serves_health_over_tls(masters, pki, trusting):
    m = masters.start(extra_args=tls_args(pki, client_ca=True))
    ctx = ssl.create_default_context(cafile=pki.ca)  # no client certificate: probes seldom have one
    with socket.create_connection(("127.0.0.1", m.http_port), timeout=2) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert json.loads(body)["status"] == "ok"
    # Plain HTTP to it gets no answer but a closed connection, soon.
    with socket.create_connection(("127.0.0.1", m.http_port), timeout=2) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert not s.recv(65536).startswith(b"HTTP/")


def test_bad_tls_settings_stop_the_master_and_the_client(masters, pki, tmp_path):
    with pytest.raises(RuntimeError, match="--tls-key"):
        masters.start(extra_args=("--tls-cert", pki.cert))
    with pytest.raises(RuntimeError, match="PDXFER_MASTER_TLS_CLIENT_CA"):
        start_local_master(workdir=masters.workdir, timeout_s=10,
                           env={"PDXFER_MASTER_TLS_CLIENT_CA": str(tmp_path / "missing.pem"),
                                "PDXFER_MASTER_TLS_CERT": pki.cert, "PDXFER_MASTER_TLS_KEY": pki.key})
    with pytest.raises(ValueError, match="key_file"):
        MasterClient("127.0.0.1:1", ca_file=pki.ca, cert_file=pki.client_cert)
    with pytest.raises(ValueError, match="ca_file"):
        MasterClient("127.0.0.1:1", ca_file=str(tmp_path / "nope.pem"))


@pytest.mark.etcd
def test_leader_found_through_etcd_is_reached_with_the_same_tls_settings(masters, pki, trusting, etcd):
    prefix = "/pdxfer-master-tls/master"
    m = masters.start(token="tok", extra_args=tls_args(pki, client_ca=True) + (
        "--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--leader-ttl", "2", "--etcd-timeout", "0.5"))
    url = f"etcd://{etcd.endpoint}{prefix}"
    c = masters.client(url, token="tok", timeout_s=5.0)
    assert c.tls is not None  # etcd itself is plain here: the master's TLS settings are the client's own
    c.register_node(node_info("holder"))
    keys = keys_for("etcd-tls", 3)
    assert c.publish("holder", [(k, [i]) for i, k in enumerate(keys)]) == 3
    assert c.lookup_and_lock(keys, reader="decode").hit_chunks == 3
    assert c.ping()["leader"] is True
    # A client following etcd without the master's CA is refused at once, naming the CA.
    untrusted = MasterClient(url, token="tok", timeout_s=1.0, ca_file=pki.other_ca, cert_file=pki.client_cert,
                             key_file=pki.client_key)
    masters.clients.append(untrusted)
    err = _refused(lambda: untrusted.stats(), 1.0)
    assert isinstance(err, MasterTlsError) and pki.other_ca in str(err), err


def test_a_peer_stalling_in_the_tls_handshake_is_dropped(masters, pki, trusting):
    m = masters.start(extra_args=tls_args(pki) + ("--handshake-timeout", "0.5"))
    with socket.create_connection(("127.0.0.1", m.port), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(b"\x16\x03\x01")  # the start of a ClientHello record, and then nothing
        assert s.recv(1024) == b""
        assert time.monotonic() - t0 < 3.0
    assert masters.client(m.address).ping()["leader"] is True
