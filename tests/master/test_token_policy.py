"""Issue 42, hole 2: a master other hosts can reach must not run without a token by accident.
Real master processes; the policy itself against every kind of listen address."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdxfer.master import start_local_master
from pdxfer.master.cli import check_token_policy


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_without_a_token_is_allowed(host):
    check_token_policy(host, has_token=False, insecure_no_token=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "master.example.internal"])
def test_a_reachable_address_without_a_token_is_refused_unless_insisted_on(host, caplog):
    with pytest.raises(SystemExit, match="without --token-file"):
        check_token_policy(host, has_token=False, insecure_no_token=False)
    check_token_policy(host, has_token=True, insecure_no_token=False)
    check_token_policy(host, has_token=False, insecure_no_token=True)
    assert "WITHOUT A TOKEN" in caplog.text


def test_the_master_refuses_to_start_on_every_address_without_a_token(tmp_path: Path):
    """(Before: it started and served anyone.)"""
    r = subprocess.run([sys.executable, "-m", "pdxfer.master.service", "--host", "0.0.0.0", "--port", "0",
                        "--http-port", "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refusing to listen on 0.0.0.0 without --token-file" in r.stderr


def test_insecure_no_token_starts_and_says_so_loudly(tmp_path: Path):
    m = start_local_master(host="0.0.0.0", extra_args=["--insecure-no-token"], workdir=tmp_path, timeout_s=30)
    try:
        assert m.alive()
        assert "WITHOUT A TOKEN" in Path(m.log_path).read_text()
    finally:
        m.stop()
