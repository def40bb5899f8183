"""start_local_master: the one way tests, benchmarks and ``pdxfer launch`` start a master."""

from __future__ import annotations

import pytest

from pdxfer.master import MasterAuthError, MasterClient, start_local_master


def test_token_file_log_name_and_graceful_stop(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    m = start_local_master(workdir=tmp_path, token_file=secret, log_name="master.log")
    try:
        assert m.alive() and m.log_path == str(tmp_path / "master.log")
        with MasterClient(m.address, token="s3cret", timeout_s=2) as c:
            assert c.ping()["leader"] is True
        with MasterClient(m.address, token="wrong", timeout_s=2) as c, pytest.raises(MasterAuthError):
            c.ping()
    finally:
        assert m.stop() == 0  # SIGTERM: the master shuts down cleanly
    assert not m.alive()
    assert "pdxfer-master listening" in (tmp_path / "master.log").read_text()


def test_a_master_that_cannot_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exited with 2.*--no-such-flag"):
        start_local_master(workdir=tmp_path, extra_args=["--no-such-flag"], timeout_s=20)
    with pytest.raises(ValueError, match="token or token_file"):
        start_local_master(workdir=tmp_path, token="a", token_file=tmp_path / "t")
