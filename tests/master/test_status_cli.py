"""`pdxfer status` against real master processes: a standalone one with a token, and replicas
elected through a real etcd. The command runs as operators run it (a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pdxfer.master.client import status_cli

from .conftest import keys_for, node_info, wait_until
from .test_etcd_ha import PREFIX, ha_args, role

TOKEN = "s3cret-status"


def run_status(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (status_cli.MASTER_ENV, status_cli.TOKEN_FILE_ENV)}
    return subprocess.run([sys.executable, "-m", "pdxfer.cli", "status", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


def status_json(address: str, token_file: str | None = None, expect_rc: int = 0) -> dict:
    args = ["--master", address, "--json"] + (["--token-file", token_file] if token_file else [])
    out = run_status(*args)
    assert out.returncode == expect_rc, out.stderr
    return json.loads(out.stdout)


def by_id(doc: dict) -> dict[str, dict]:
    return {n["node_id"]: n for n in doc["nodes"]}


def test_status_reports_holdings_locks_and_leases_of_each_node(masters, tmp_path):
    m = masters.start(token=TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    c = masters.client(m.address, token=TOKEN, timeout_s=5.0)
    serving = dict(serve_url="http://127.0.0.1:8100", namespace="ab" * 8, chunk_tokens=16, role="kv_producer")
    meta = json.dumps({"kind": "tcp", "host": "127.0.0.1", "port": 4567, "secret": "00ff"}).encode()
    a = dataclasses.replace(node_info("prefill-a"), transport_metadata=meta, tp_size=1, total_kv_heads=4,
                            layout={"block_size": 16, "dtype": "float16"}, **serving)
    reg_a = c.register_node(a, 30)
    c.register_node(dataclasses.replace(node_info("decode-b"), role="kv_consumer"), 30)
    keys = keys_for("status", 6)
    c.publish("prefill-a", [(k, [i, i + 100]) for i, k in enumerate(keys)])  # 6 chunks, 12 blocks
    c.publish("decode-b", [(keys[0], [7])])

    doc = status_json(m.address, str(token_file))
    assert set(doc) == {"master", "nodes"}
    master = doc["master"]
    assert master["leader"] is True and master["store"] == "memory" and master["degraded"] is None
    assert master["epoch"] == reg_a.epoch >> 32  # the incarnation's part of every registration epoch
    nodes = by_id(doc)
    assert sorted(nodes) == ["decode-b", "prefill-a"]
    na, nb = nodes["prefill-a"], nodes["decode-b"]
    assert (na["entries"], na["blocks"], na["locks"]) == (6, 12, 0)
    assert (nb["entries"], nb["blocks"], nb["locks"]) == (1, 1, 0)
    assert na["epoch"] == reg_a.epoch and na["role"] == "kv_producer" and nb["role"] == "kv_consumer"
    assert na["serve_url"] == "http://127.0.0.1:8100" and na["transport"] == "tcp"
    assert na["endpoints"] == [{"rank": 0, "endpoint": "127.0.0.1:4567"}]
    assert "00ff" not in json.dumps(doc)  # the transfer secret in the metadata is never shown
    assert na["layout"] == {"block_size": 16, "dtype": "float16", "kv_heads": 4, "tp": 1, "chunk_tokens": 16,
                            "namespace": "ab" * 8, "fingerprint": "fp-test"}
    assert na["lease_ttl_s"] == 30.0 and 0 <= na["heartbeat_age_s"] < 10 and na["lease_left_s"] > 20

    lock = c.lookup_and_lock(keys[:3], reader="r")
    c.unpublish_if_unlocked("prefill-a", keys[4:])
    time.sleep(1.2)
    nodes = by_id(status_json(m.address, str(token_file)))
    # the lock pins one holder's entries: prefill-a, which holds the longest run
    assert (nodes["prefill-a"]["entries"], nodes["prefill-a"]["blocks"], nodes["prefill-a"]["locks"]) == (4, 8, 1)
    assert nodes["prefill-a"]["heartbeat_age_s"] >= 1.0
    assert c.heartbeat("prefill-a")
    assert c.release(lock.lock_id)
    nodes = by_id(status_json(m.address, str(token_file)))
    assert nodes["prefill-a"]["locks"] == 0 and nodes["prefill-a"]["heartbeat_age_s"] < 1.0

    table = run_status("--master", m.address, "--token-file", str(token_file))
    assert table.returncode == 0, table.stderr
    assert "prefill-a" in table.stdout and "decode-b" in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())


def test_wrong_or_missing_token_is_refused_and_shows_nothing(masters, tmp_path):
    m = masters.start(token=TOKEN)
    c = masters.client(m.address, token=TOKEN)
    c.register_node(node_info("hidden-node"), 30)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    for extra in (["--token-file", str(wrong)], []):
        out = run_status("--master", m.address, "--json", *extra)
        assert out.returncode == status_cli.EXIT_AUTH, (out.returncode, out.stderr)
        assert out.stdout == "" and "hidden-node" not in out.stderr


def test_unreachable_master_exits_within_the_timeout():
    silent = socket.socket()  # accepts connections (backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        for sock in (silent, closed):
            t0 = time.monotonic()
            out = run_status("--master", "127.0.0.1:%d" % sock.getsockname()[1], "--timeout", "1", "--json")
            took = time.monotonic() - t0
            assert out.returncode == status_cli.EXIT_UNREACHABLE, (out.returncode, out.stderr)
            assert out.stdout == "" and took < 1 + 8  # the bound plus the interpreter's start
    finally:
        silent.close()
        closed.close()


@pytest.mark.etcd
def test_etcd_leader_and_standby(etcd, masters):
    a = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(a.address), 10, "the first replica to lead")
    b = masters.start(extra_args=ha_args(etcd))
    wait_until(lambda: role(b.address) is False, 10, "the second replica to stand by")
    url = f"etcd://{etcd.endpoint}{PREFIX}"
    c = masters.client(url, timeout_s=5.0)
    reg = c.register_node(node_info("holder"), 30)
    c.publish("holder", [(k, [1, 2, 3]) for k in keys_for("etcd-status", 2)])

    doc = status_json(url)
    m = doc["master"]
    assert m["store"] == "etcd" and m["leader"] is True and m["degraded"] is None
    assert m["leader_address"] == a.address and m["replica_id"] and m["epoch"] == reg.epoch >> 32
    assert [(n["node_id"], n["entries"], n["blocks"]) for n in doc["nodes"]] == [("holder", 2, 6)]

    standby = status_json(b.address, expect_rc=status_cli.EXIT_NO_LEADER)
    assert standby["master"]["leader"] is False and standby["master"]["leader_address"] == a.address
    assert standby["nodes"] == []
