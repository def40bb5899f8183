"""The master's GET /metrics, scraped from a real running master over HTTP and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from pdxfer.master.wire import protocol as P
from pdxfer.master.server.metrics import MASTER_METRICS, REQUEST_BUCKETS
from pdxfer.master.server.master_service import MasterService

from .conftest import keys_for, node_info, sample_value, scrape_master, wait_until

REQUEST = "pdxfer_master_request_seconds"


def test_every_defined_metric_is_exported_with_its_kind_and_help(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("k"), 30)
    with urllib.request.urlopen(f"http://{master.http_address}/metrics", timeout=2) as r:
        assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for d in MASTER_METRICS:
        assert d.name in fams, d.name
        f = fams[d.name]
        assert (f.type, f.documentation) == (d.kind, d.help), d.name
        names = {s.name for s in f.samples}
        assert set(d.exposed_names()) <= names, (d.name, names)
        for s in f.samples:
            if s.name in d.exposed_names():
                assert set(s.labels) - {"le"} == set(d.labels), (s.name, s.labels)
    assert "pdxfer_master_lookups_per_second" not in fams  # removed: rate() of lookups_total
    assert fams["process_resident_memory_bytes"].samples[0].value > 0
    assert fams["process_open_fds"].samples[0].value > 0
    # Nothing is exported that is not defined, apart from the process's own metrics and the
    # histogram's creation times (prometheus_client's <name>_created, one per op).
    defined = {d.name for d in MASTER_METRICS} | {d.name + "_created" for d in MASTER_METRICS if d.kind == "histogram"}
    undefined = {n for n in fams if n.startswith("pdxfer_")} - defined
    assert not undefined, undefined


def test_request_seconds_count_each_op_once_per_request(master, masters):
    ops = [n for op, n in P.OP_NAMES.items() if op != P.OP_HELLO]
    # The start-up's readiness ping was served too: count from here.
    before = {n: sample_value(scrape_master(master.http_address), f"{REQUEST}_count", op=n) for n in ops}
    c = masters.client(master.address)
    c.register_node(node_info("q"), 30)
    keys = keys_for("req", 4)
    c.publish("q", [(k, [i]) for i, k in enumerate(keys)])
    locks = [c.lookup_and_lock(keys, reader="d").lock_id for _ in range(3)]
    for lid in locks[:2]:
        assert c.release(lid) is True
    assert c.peek(keys).hit == 4
    assert c.heartbeat("q") is True
    fams = scrape_master(master.http_address)
    want = {"register": 1, "publish": 1, "lookup_and_lock": 3, "release": 2, "peek": 1, "heartbeat": 1}
    for name in ops:
        count = sample_value(fams, f"{REQUEST}_count", op=name)
        assert count - before[name] == want.get(name, 0), (name, count, before[name])
        buckets = sorted((float(s.labels["le"]), s.value) for s in fams[REQUEST]
                         if s.name == f"{REQUEST}_bucket" and s.labels["op"] == name)
        assert [le for le, _ in buckets] == [*REQUEST_BUCKETS, float("inf")]
        assert buckets[-1][1] == count
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), (name, buckets)
    assert sample_value(fams, f"{REQUEST}_sum", op="lookup_and_lock") > 0
    # hello is answered before any op and is no op of the histogram
    assert not [s for s in fams[REQUEST] if s.labels.get("op") == "hello"]


def test_held_blocks_match_what_was_published(master, masters):
    from bench.pd_util import scrape  # bench/soak.py reads the master's gauges through it

    c = masters.client(master.address)
    c.register_node(node_info("a"), 30)
    c.register_node(node_info("b"), 30)
    keys = keys_for("held", 5)
    c.publish("a", [(k, list(range(i + 1))) for i, k in enumerate(keys)])  # 1+2+3+4+5
    c.publish("b", [(keys[0], [7, 8])])
    c.publish("a", [(keys[4], [9])])  # re-published with 1 block instead of 5
    assert c.unpublish_if_unlocked("a", [keys[3]]) == [keys[3]]
    assert sample_value(scrape_master(master.http_address), "pdxfer_master_held_blocks") == 1 + 2 + 3 + 1 + 2
    blocks = {n["node_id"]: n["blocks"] for n in c.status()["nodes"]}
    assert blocks == {"a": 7, "b": 2}
    c.deregister_node("b")
    soak_view = scrape(f"http://{master.http_address}")
    assert soak_view["pdxfer_master_held_blocks"] == 7
    assert soak_view["pdxfer_master_entries"] == 4 and soak_view["pdxfer_master_nodes"] == 1


def test_a_lock_left_to_expire_counts_as_an_expiry_not_a_release(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("e"), 30)
    keys = keys_for("left", 2)
    c.publish("e", [(k, [i]) for i, k in enumerate(keys)])
    r = c.lookup_and_lock(keys, reader="d", lock_ttl_s=0.2)
    assert r.hit_chunks == 2

    def expiries() -> float:
        return sample_value(scrape_master(master.http_address), "pdxfer_master_lock_expiries_total")

    wait_until(lambda: expiries() == 1, 5, "the reaper to drop the lock at its deadline")
    fams = scrape_master(master.http_address)
    assert sample_value(fams, "pdxfer_master_locks") == 0
    assert sample_value(fams, "pdxfer_master_releases_ok_total") == 0
    assert sample_value(fams, "pdxfer_master_releases_expired_total") == 0
    # Its reader's late release is an expired release; the lock still expired once.
    assert c.release(r.lock_id) is False
    fams = scrape_master(master.http_address)
    assert sample_value(fams, "pdxfer_master_releases_expired_total") == 1
    assert sample_value(fams, "pdxfer_master_lock_expiries_total") == 1


def test_services_in_one_process_have_registries_of_their_own():
    a, b = MasterService(), MasterService()
    a.index.register("n", "{}", 30.0, now=0.0)
    fams_a = {f.name: f for f in text_string_to_metric_families(a.metrics.render().decode())}
    fams_b = {f.name: f for f in text_string_to_metric_families(b.metrics.render().decode())}
    assert fams_a["pdxfer_master_nodes"].samples[0].value == 1
    assert fams_b["pdxfer_master_nodes"].samples[0].value == 0


def test_the_definitions_import_without_prometheus_client():
    code = ("import sys, pdxfer.master.server.metrics as m; assert m.MASTER_METRICS; "
            "assert 'prometheus_client' not in sys.modules, 'imported prometheus_client'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
