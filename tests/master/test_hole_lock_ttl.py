"""Issue 9, hole 6: readers choose lock TTLs but holders must know how long a lock can pin their
blocks. The master caps every lock TTL at a value it announces in the register reply."""

from __future__ import annotations

import time

from .conftest import keys_for, node_info


def test_default_cap_applies_to_an_hour_long_lock(master, masters):
    c = masters.client(master.address)
    c.register_node(node_info("p"), 30)
    keys = keys_for("cap", 2)
    c.publish("p", [(k, [1]) for k in keys])
    r = c.lookup_and_lock(keys, reader="greedy", lock_ttl_s=3600)
    assert r.hit_chunks == 2
    assert r.lock_ttl_s == 30.0, "the master granted a lock longer than its default cap"


def test_cap_is_announced_and_enforced(masters):
    m = masters.start(extra_args=("--max-lock-ttl", "1"))
    c = masters.client(m.address)
    reg = c.register_node(node_info("p"), 30)
    assert reg.max_lock_ttl_s == 1.0
    keys = keys_for("cap1", 2)
    c.publish("p", [(k, [1]) for k in keys])
    r = c.lookup_and_lock(keys, reader="greedy", lock_ttl_s=3600)
    assert r.lock_ttl_s == 1.0
    assert c.unpublish_if_unlocked("p", keys) == []  # pinned while the lock lives
    time.sleep(1.3)
    # past the cap the holder may free: the lock no longer pins, and its release says False
    assert c.unpublish_if_unlocked("p", keys) == keys
    assert c.release(r.lock_id) is False
