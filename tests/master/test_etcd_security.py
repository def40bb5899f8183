"""etcd TLS/auth settings: where they come from (etcd:// options, then environment; master flags
become options) and the errors for bad ones. No etcd needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdxfer.master.backends import etcd_layout
from pdxfer.master.backends.etcd_security import EtcdSecurity
from pdxfer.common.procs import python_env


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    out = {}
    for name in ("ca", "cert", "key", "pw"):
        p = tmp_path / name
        p.write_text("x\n")
        out[name] = str(p)
    return out


def test_options_from_url_win_over_environment(files):
    env = {"PDXFER_ETCD_CA_FILE": files["key"], "PDXFER_ETCD_USER": "from-env",
           "PDXFER_ETCD_PASSWORD_FILE": files["pw"]}
    t = etcd_layout.parse_etcd_url(f"etcd://h:1,h:2/a/b?ca={files['ca']}", env)
    assert t.endpoints == [("h", 1), ("h", 2)] and t.prefix == "/a/b"
    assert t.security == EtcdSecurity(ca_file=files["ca"], user="from-env", password_file=files["pw"])
    assert t.security.tls and t.security.scheme == "https"
    # no prefix, options only
    t = etcd_layout.parse_etcd_url(f"etcd://h:1?cert={files['cert']}&key={files['key']}", {})
    assert t.prefix == etcd_layout.DEFAULT_PREFIX and t.security.tls and t.security.ca_file is None
    assert not etcd_layout.parse_etcd_url("etcd://h:1", {}).security.tls
    assert etcd_layout.parse_etcd_url("etcd://h:1?tls=1", {}).security.scheme == "https"


def test_url_round_trips_through_etcd_url(files):
    sec = EtcdSecurity(ca_file=files["ca"], cert_file=files["cert"], key_file=files["key"], user="u",
                       password_file=files["pw"])
    url = etcd_layout.etcd_url("h:1,h:2", "/team/m", sec)
    assert etcd_layout.parse_etcd_url(url, {}) == etcd_layout.EtcdTarget([("h", 1), ("h", 2)], "/team/m", sec)


@pytest.mark.parametrize("query, env, message", [
    ("foo=1", {}, r"unknown etcd option 'foo'"),
    ("cert={cert}", {}, r"give both cert= and key="),
    ("user=u", {}, r"needs both user= and password-file="),
    ("ca=/no/such/ca.pem", {}, r"etcd option ca= /no/such/ca.pem: not a readable file"),
    ("", {"PDXFER_ETCD_CA_FILE": "/no/such/ca.pem"}, r"\$PDXFER_ETCD_CA_FILE /no/such/ca.pem: not a readable"),
    ("tls=yes", {}, r"tls= must be 0 or 1, got 'yes'"),
    ("tls=0&ca={ca}", {}, r"tls= is 0 but a CA or client certificate is given"),
    ("ca=", {}, r"etcd option ca= is empty"),
    ("ca={ca}&ca={ca}", {}, r"ca= given twice"),
])
def test_bad_settings_are_named(files, query, env, message):
    with pytest.raises(ValueError, match=message):
        etcd_layout.parse_etcd_url("etcd://h:1/p?" + query.format(**files), env)


def test_master_flags_become_options_and_a_bad_one_stops_it(files, tmp_path):
    from pdxfer.master import cli

    args = cli.build_parser().parse_args(["--etcd", "h:1", "--etcd-ca", files["ca"], "--etcd-user", "u",
                                          "--etcd-password-file", files["pw"]])
    assert (args.etcd_opt_ca, args.etcd_opt_user, args.etcd_opt_cert) == (files["ca"], "u", None)
    proc = subprocess.run([sys.executable, "-m", "pdxfer.master.service", "--etcd", "127.0.0.1:1",
                           "--etcd-ca", str(tmp_path / "missing.pem")],
                          capture_output=True, text=True, timeout=60, env=python_env())
    assert proc.returncode != 0
    assert f"etcd option ca= {tmp_path / 'missing.pem'}: not a readable file" in proc.stderr, proc.stderr


def test_unloadable_tls_files_are_named_when_the_client_is_made(files):
    from pdxfer.master import MasterClient

    with pytest.raises(ValueError, match=r"client certificate .*cert.*cannot be loaded"):
        MasterClient(f"etcd://127.0.0.1:1/p?cert={files['cert']}&key={files['key']}")
