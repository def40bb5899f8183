"""kv_connector_extra_config parsing: every bad input names what is wrong (no vLLM needed)."""

from __future__ import annotations

import pytest

from pdxfer.contracts.connector_config import MASTER_ENV, SERVE_URL_ENV, ConnectorConfigError, parse_extra_config
from pdxfer.vllm.metadata import METADATA_VERSION, MetadataVersionError, PdxferConnectorMetadata


def test_defaults_and_master_from_env():
    cfg = parse_extra_config({}, env={MASTER_ENV: "127.0.0.1:7000"})
    assert cfg.master == "127.0.0.1:7000" and cfg.transport == "tcp" and cfg.chunk_tokens == 256
    assert parse_extra_config({"master": "h:1", "lock_ttl_s": 3}, env={}).lock_ttl_s == 3.0
    # Waits that 0 turns off (issue 12: the prefill does not wait for its publish by default).
    assert cfg.publish_wait_s == 0.0 and cfg.publish_hint_wait_s > 0
    assert parse_extra_config({"master": "h:1", "publish_hint_wait_s": 0}, env={}).publish_hint_wait_s == 0.0


@pytest.mark.parametrize("extra, needle", [
    ({"master": "h:1", "chunk_tokns": 256}, "chunk_tokns"),
    ({}, "master"),
    ({"master": "h:1", "transport": "rdma"}, "transport"),
    ({"master": "h:1", "chunk_tokens": 0}, "chunk_tokens"),
    ({"master": "h:1", "chunk_tokens": True}, "chunk_tokens"),
    ({"master": "h:1", "lock_ttl_s": "10"}, "lock_ttl_s"),
    ({"master": "h:1", "max_held_fraction": 1.5}, "max_held_fraction"),
    ({"master": "h:1", "lock_ttl_s": 0.2, "lookup_timeout_s": 0.5}, "lock_ttl_s"),
    ({"master": ""}, "master"),
    ({"master": "h:1", "publish_wait_s": -0.1}, "publish_wait_s"),
    ({"master": "h:1", "publish_hint_wait_s": "soon"}, "publish_hint_wait_s"),
    ({"master": "h:1", "lease_ttl_s": 0}, "lease_ttl_s"),
    ({"master": "h:1", "publish_as_decode": "false"}, "publish_as_decode"),
    ({"master": "h:1", "publish_as_decode": 0}, "publish_as_decode"),
    ({"master": "h:1", "serve_url": "10.0.0.5:8100"}, "serve_url"),
    ({"master": "h:1", "serve_url": "ftp://h:8100"}, "serve_url"),
    ({"master": "h:1", "serve_url": "http://:8100"}, "serve_url"),
    ({"master": "h:1", "serve_url": "http://h:70000"}, "serve_url"),
    ({"master": "h:1", "serve_url": "http://h:8100/?x=1"}, "serve_url"),
    ({"master": "h:1", "serve_url": ""}, "serve_url"),
    ({"master": "h:1", "serve_url": 8100}, "serve_url"),
])
def test_bad_values_name_the_key(extra, needle):
    with pytest.raises(ConnectorConfigError, match=needle):
        parse_extra_config(extra, env={})


def test_token_file_errors_name_the_file(tmp_path):
    cfg = parse_extra_config({"master": "h:1", "master_token_file": str(tmp_path / "nope")}, env={})
    with pytest.raises(ConnectorConfigError, match="nope"):
        _ = cfg.token
    (tmp_path / "tok").write_text("s3cret\n")
    assert parse_extra_config({"master": "h:1", "master_token_file": str(tmp_path / "tok")}, env={}).token == "s3cret"


def test_metadata_version_is_checked():
    PdxferConnectorMetadata().check()
    with pytest.raises(MetadataVersionError, match="version"):
        PdxferConnectorMetadata(version=METADATA_VERSION + 1).check()


def test_decodes_publish_by_default_and_the_serve_url_comes_from_the_config_or_env():
    cfg = parse_extra_config({"master": "h:1"}, env={})
    assert cfg.publish_as_decode is True and cfg.serve_url is None
    assert parse_extra_config({"master": "h:1", "publish_as_decode": False}, env={}).publish_as_decode is False
    # A router appends paths to it: no trailing slash.
    env = {SERVE_URL_ENV: "http://10.0.0.5:8100/"}
    assert parse_extra_config({"master": "h:1"}, env=env).serve_url == "http://10.0.0.5:8100"
    # The config's own value wins over the environment's.
    assert parse_extra_config({"master": "h:1", "serve_url": "https://d1.example:443"},
                              env=env).serve_url == "https://d1.example:443"
    with pytest.raises(ConnectorConfigError, match=SERVE_URL_ENV):
        parse_extra_config({"master": "h:1"}, env={SERVE_URL_ENV: "nope"})
