"""A worker's connector stats carry what unauthenticated peers cost its TCP holder (issue 42,
hole 7): a real WorkerSide with the real TCP transport, a raw socket with a guessed secret, and
the stats as vLLM's connector-stats pipeline keeps them (PdxferKVConnectorStats)."""

from __future__ import annotations

import os
import socket
import time

import pytest

pytest.importorskip("vllm")

from pdxfer.contracts.connector_config import parse_extra_config  # noqa: E402
from pdxfer.kv.layout import describe_kv_caches  # noqa: E402
from pdxfer.transport.tcp import handshake  # noqa: E402
from pdxfer.transport.tcp.metadata import parse_metadata  # noqa: E402
from pdxfer.vllm.connector_stats import PdxferKVConnectorStats  # noqa: E402
from pdxfer.vllm.worker.worker_side import WorkerSide  # noqa: E402
from tests.vllm.test_connector_flow import BS, _kv  # noqa: E402


def test_a_guessed_secret_reaches_the_connector_stats_once(master):
    kv = _kv(1)
    layout = describe_kv_caches(kv, block_size=BS)
    cfg = parse_extra_config({"master": master.address, "transport": "tcp"})
    worker = WorkerSide(cfg, node_id="guarded-r0", rank=0, expected_fingerprint=layout.fingerprint(), block_size=BS)
    try:
        worker.register_kv_caches(kv)
        meta = parse_metadata(worker.transport.metadata())
        assert worker.take_stats() is None  # nothing happened yet
        s = socket.create_connection((meta.host, meta.port), timeout=5)
        with pytest.raises(handshake.AuthRefused):
            handshake.prove(s, meta.instance, os.urandom(32), time.monotonic() + 5, "holder")
        s.close()
        deadline = time.monotonic() + 5
        while (got := worker.take_stats()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == {"holder_auth_failures": 1}, got
        assert PdxferKVConnectorStats(data=got).data["holder_auth_failures"] == 1  # a counter vLLM exports
        assert worker.take_stats() is None  # reported once
    finally:
        worker.close()
