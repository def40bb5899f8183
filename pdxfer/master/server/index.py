"""The chunk index and its lifetime rules, in memory. Single-threaded: the service calls it from
its event loop only, so every operation is atomic with respect to every other one; this is the one
place where lock validity and unpublish are ordered (docs/architecture.md, "Never wrong KV").

Rules:
- A node is registered under a lease (``ttl``); each heartbeat extends it by ``ttl``. A node whose
  lease ran out is dropped together with every entry it published and every lock that pinned one
  of its entries (release of such a lock returns False). Registering an id that is already
  registered starts a new incarnation: the old one's entries and locks are dropped.
- An entry is (key, node) -> block ids, with an optional hold-until (retention). Past its
  hold-until an entry is no longer served to lookups; it stays until the holder unpublishes it
  (which then succeeds unless a lock is still valid) or its node goes away.
- ``lookup_and_lock`` returns the longest contiguous prefix of the keys that some live node holds,
  picks holders greedily (the node with the longest run from the current chunk, so the first pick
  is a node holding the longest prefix) and pins the chosen entries under one lock with a
  deadline. When several holders tie for the longest run, the index rotates among them (by node
  id, one step per tie it breaks, a counter of the index): copies of the same prefix on several
  engines share its reads, and the choice is still deterministic for a given call sequence. Only holders the reader can use are candidates: a
  lookup names the registrations it cannot read (``skip``; epoch 0: any registration of the node)
  and its transport, so an unreadable holder's longer run never hides a readable one. A lookup
  may name a preferred tier (``prefer_tier``): candidates holding chunk i in that tier come first,
  each for as far as its run stays in it (``index_reads.in_tier``); the hit's length never depends on it.
- What one publish call sets on a node is also kept as a run (``PublishedRun``): a lookup whose keys
  follow an intact run reads that span with one comparison and one slice. It changes no answer:
  ``ChunkIndex(spans=False)`` reads key by key and answers the same.
- ``release`` is True only if the lock was still valid when the release arrived.
- ``unpublish_if_unlocked`` removes an entry only when no valid lock pins it, and reports every
  key the node no longer publishes (removed now, or never/no longer there): those blocks are free
  to reuse, since a lock can only pin an entry that exists.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.master.server.index_records import (
    Counters,
    Entry,
    FencedError,
    Lock,
    LookupOutcome,
    Node,
    PeekOutcome,
    PublishedRun,
    SupersededError,
    UnknownNodeError,
)
from pdxfer.master.server.index_reads import (
    Picked,
    block_counts,
    in_tier,
    joined_keys,
    node_run,
    peek_prefixes,
    usable_filter,
)

INF = math.inf
EPOCH_PREFIX_MASK = (1 << 29) - 1  # epochs stay below 2**61: under the wire's bound of 2**62
# The connector's test-hook directory (pdxfer/contracts/connector_config.py): the master reads one hook from it.
TEST_HOOKS_ENV = "PDXFER_TEST_HOOKS_DIR"
TIE_HOOK = "tie_break_node"

__all__ = ["ChunkIndex", "FencedError", "LookupOutcome", "PeekOutcome", "SupersededError", "UnknownNodeError"]


def _hooked_tie(hooks_dir: str, tied: Sequence[tuple[str, Picked, Node]], k: int) -> int:
    """Tie ``k`` unless hook file ``tie_break_node`` (read at each tie) names one of the tied
    node ids: then that one, so that a test knows which holder a reader's lookup picks."""
    try:
        want = (Path(hooks_dir) / TIE_HOOK).read_text().strip()
    except OSError:
        return k
    return next((j for j, (nid, _, _) in enumerate(tied) if nid == want), k)


class ChunkIndex:
    def __init__(self, max_entries: int = 10_000_000, lock_prefix: str | None = None,
                 spans: bool = True) -> None:
        """``spans``: lookups read the spans of published runs (PublishedRun) where they can;
        False reads key by key everywhere (same answers, slower: the reference tests compare)."""
        self.spans = spans
        self.nodes: dict[str, Node] = {}
        self.entries: dict[bytes, dict[str, Entry]] = {}
        self.locks: dict[str, Lock] = {}
        self.max_entries = max_entries
        self.n_entries = 0
        self.held_blocks = 0  # sum of every node's held_blocks (see Node)
        self.counters = Counters()
        # Lock ids carry a per-incarnation prefix: a lock granted by a previous master (before a
        # failover or restart) is never mistaken for one of ours, so its release says False.
        self._lock_prefix = lock_prefix or os.urandom(4).hex()
        self._lock_seq = itertools.count(1)
        # Registration epochs carry a random per-incarnation prefix in their high bits: a reader
        # caches node descriptions by (node, epoch), and a restarted or failed-over master counting
        # from 1 again would make it keep a previous holder's metadata (issue 9, hole 7). Epochs
        # also identify a registration in every later call of the node (hole 2).
        self.epoch_prefix = int.from_bytes(os.urandom(4), "big") & EPOCH_PREFIX_MASK
        self._epochs = itertools.count(self.epoch_prefix << 32 | 1)
        self._lock_heap: list[tuple[float, str]] = []
        self._ties_broken = 0  # rotates the choice among holders tied for the longest run
        # Tests only (docs/connector.md, fault hooks): None unless $PDXFER_TEST_HOOKS_DIR is set.
        self._test_hooks = os.environ.get(TEST_HOOKS_ENV) or None
        self.on_node_dropped: Callable[[str, str], None] | None = None  # (node id, why)

    # ---- membership ---------------------------------------------------------------------------

    def register(self, node_id: str, info_json: str, ttl: float, now: float, transport: str | None = None,
                 host_base: int | None = None) -> int:
        """``host_base``: the node's first host-tier block id (None: no host tier)."""
        if node_id in self.nodes:
            self._drop_node(node_id, "re-registered")
        node = Node(node_id, info_json, ttl, now + ttl, next(self._epochs), transport, host_base)
        self.nodes[node_id] = node
        return node.epoch

    def heartbeat(self, node_id: str, now: float, epoch: int | None = None) -> float | None:
        """Extend the lease; the new remaining time, or None when the node is not (or no longer) known.
        SupersededError when ``epoch`` names an older registration of the node."""
        node = self.nodes.get(node_id)
        if node is None:
            return None
        self._check_epoch(node, epoch)
        if node.expires_at <= now:
            self._drop_node(node_id, "lease expired")
            return None
        node.expires_at = now + node.ttl
        return node.ttl

    def deregister(self, node_id: str, epoch: int | None = None) -> bool:
        node = self.nodes.get(node_id)
        if node is None:
            return False
        self._check_epoch(node, epoch)  # a superseded registration must not drop its successor
        self._drop_node(node_id, "deregistered")
        return True

    @staticmethod
    def _check_epoch(node: Node, epoch: int | None) -> None:
        # None: an in-process caller (tests) that does not name a registration; the wire always does.
        if epoch is not None and epoch != node.epoch:
            raise SupersededError(node.node_id, epoch, node.epoch)

    def _live_node(self, node_id: str, now: float, epoch: int | None = None) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(node_id)
        self._check_epoch(node, epoch)
        if node.expires_at <= now:
            self._drop_node(node_id, "lease expired")
            raise UnknownNodeError(node_id)
        return node

    def _drop_node(self, node_id: str, why: str) -> None:
        node = self.nodes.pop(node_id)
        for lock_id in list(node.locks):
            lock = self.locks.pop(lock_id, None)
            if lock is not None:
                self.counters.locks_invalidated += 1
                self._unpin(lock)
        for key, entry in node.entries.items():
            entry.run = None  # its runs go with it (no cycle left for the collector)
            holders = self.entries.get(key)
            if holders is not None:
                holders.pop(node_id, None)
                if not holders:
                    del self.entries[key]
        self.n_entries -= len(node.entries)
        self.held_blocks -= node.held_blocks
        node.entries = {}
        node.held_blocks = 0
        if why == "lease expired":
            self.counters.nodes_expired += 1
        if self.on_node_dropped is not None:
            self.on_node_dropped(node_id, why)

    # ---- entries ------------------------------------------------------------------------------

    def publish(
        self, node_id: str, items: Iterable[tuple[bytes, bytes]], retention_s: float | None, now: float,
        epoch: int | None = None, seq: int | None = None,
    ) -> int:
        """Add or refresh entries; returns how many were accepted.

        FencedError (nothing applied) when ``seq`` is at or below the node's fence. Refused per key:
        re-publishing a key with *different* blocks while a valid lock pins the old ones
        (a reader is copying them), and anything beyond ``max_entries``.
        """
        node = self._live_node(node_id, now, epoch)
        if seq is not None and seq <= node.fence_seq:
            self.counters.publish_fenced += 1
            raise FencedError(node_id, seq, node.fence_seq)
        hold_until = INF if retention_s is None else now + retention_s
        if hold_until < node.hold_floor:
            node.hold_floor = hold_until
        accepted = 0
        pinned: set[bytes] | None = None  # the node's pinned keys, computed when first needed
        set_keys: list[bytes] = []  # what this publish set, in its order: its PublishedRun
        set_entries: list[Entry] = []
        for key, blocks in items:
            if node.per != len(blocks) >> 2:
                node.per = len(blocks) >> 2 if node.per == -2 else -1
            old = node.entries.get(key)
            if old is not None:
                if old.blocks != blocks:
                    if pinned is None:
                        pinned = self._pinned_keys(node, now)
                    if key in pinned:
                        self.counters.publish_refused += 1
                        continue
                nblocks = len(blocks) >> 2
                node.held_blocks += nblocks - old.nblocks
                self.held_blocks += nblocks - old.nblocks
                old.blocks = blocks
                old.nblocks = nblocks
                old.hold_until = hold_until
                PublishedRun.leave(old)
                set_keys.append(key)
                set_entries.append(old)
                accepted += 1
                continue
            if self.n_entries >= self.max_entries:
                self.counters.publish_refused += 1
                continue
            entry = Entry(node, blocks, hold_until)
            node.entries[key] = entry
            node.held_blocks += entry.nblocks
            self.held_blocks += entry.nblocks
            holders = self.entries.get(key)
            if holders is None:
                self.entries[key] = {node_id: entry}
            else:
                holders[node_id] = entry
            self.n_entries += 1
            set_keys.append(key)
            set_entries.append(entry)
            accepted += 1
        self.counters.published += accepted
        self._new_run(set_keys, set_entries, hold_until)
        return accepted

    @staticmethod
    def _new_run(keys: list[bytes], entries: list[Entry], hold_until: float) -> None:
        """Make what one publish set a run, unless a key came twice (its entry would stand at two
        places) or a key is not KEY_BYTES long (spans are found by key offsets)."""
        if not entries or set(map(len, keys)) != {KEY_BYTES} or len(set(keys)) != len(keys):
            return
        run = PublishedRun(b"".join(keys), entries, hold_until)
        for pos, entry in enumerate(entries):
            entry.run = run
            entry.pos = pos

    def _pinned_keys(self, node: Node, now: float) -> set[bytes]:
        """The node's keys that a still-valid lock pins."""
        pinned: set[bytes] = set()
        locks = self.locks
        for lid in node.locks:
            lock = locks.get(lid)
            if lock is not None and lock.deadline > now:
                pinned.update(lock.pins.get(node.node_id, ()))
        return pinned

    def fence(self, node_id: str, upto: int, now: float, epoch: int | None = None) -> int:
        """Refuse every later publish of the node with seq <= ``upto``; the node's fence (it never
        goes back)."""
        node = self._live_node(node_id, now, epoch)
        node.fence_seq = max(node.fence_seq, upto)
        return node.fence_seq

    def unpublish_if_unlocked(self, node_id: str, keys: Sequence[bytes], now: float,
                              epoch: int | None = None, fence: int | None = None) -> list[int]:
        """Indices (into ``keys``) the node no longer publishes: removed now, or already absent.

        Locked entries are kept and left out. Absent keys are reported so the holder can tell "locked"
        from "never arrived" (a publish that timed out unapplied) and free those blocks at once.
        """
        node = self._live_node(node_id, now, epoch)
        if fence is not None and fence > node.fence_seq:
            # First the fence, then the removal, in one step: no publish the holder gave up on can
            # be applied after these keys are reported free.
            node.fence_seq = fence
        removed: list[int] = []
        pinned = self._pinned_keys(node, now) if node.locks else ()
        for i, key in enumerate(keys):
            entry = node.entries.get(key)
            if entry is None:
                removed.append(i)
                continue
            if key in pinned:
                self.counters.unpublish_refused += 1
                continue
            del node.entries[key]
            PublishedRun.leave(entry)
            node.held_blocks -= entry.nblocks
            self.held_blocks -= entry.nblocks
            holders = self.entries[key]
            del holders[node_id]
            if not holders:
                del self.entries[key]
            self.n_entries -= 1
            removed.append(i)
            self.counters.unpublished += 1
        return removed

    # ---- lookups and locks --------------------------------------------------------------------

    def lookup_and_lock(self, keys: Sequence[bytes], reader: str, ttl: float, now: float,
                        parties: int = 1, skip: Mapping[str, int] | None = None,
                        transport: str | None = None, prefer_tier: str | None = None,
                        joined: bytes | None = None) -> LookupOutcome:
        """``parties``: how many releases the lock expects (one per TP rank reading under it).
        ``skip`` (node id -> epoch, 0 = every registration) and ``transport``: holders the reader
        cannot use; none of them is chosen, as if it did not hold the chunks. ``prefer_tier``
        (pdxfer.kv.tiers; None: no preference): the tier this reader measured faster; where
        several holders hold chunk i, one holding it in that tier is taken, for as far as its run
        stays in the tier. The hit is as long either way (it ends where no usable holder holds a
        chunk); only where its chunks are read from changes. ``joined``: the keys joined, when the
        caller has them so (the wire's key blob); spans of published runs are read with it."""
        joined = joined_keys(keys, joined, self.spans)
        c = self.counters
        usable = usable_filter(skip, transport)
        c.lookups += 1
        c.lookup_chunks += len(keys)
        entries = self.entries
        chosen: list[Entry] = []
        block_ids: list[bytes] = []  # the chosen entries' block ids, in pieces (see node_run)
        runs: list[tuple[str, int]] = []  # (node id, chunks)
        n = len(keys)
        i = 0
        # Greedy: at chunk i, take the live usable holder with the longest run from here (ties:
        # rotate among them) and stay on it for its whole run. The first pick is thus a node
        # holding the longest prefix. A chunk nobody live holds ends the prefix: a miss at chunk
        # i hides chunks i+1... Each run is read with C-speed maps (see node_run).
        while i < n:
            holders = entries.get(keys[i])
            if holders is None:
                break
            live = [e.node for e in holders.values() if e.hold_until > now and e.node.expires_at > now
                    and (usable is None or usable(e.node))]
            if not live:
                break
            if len(live) == 1:
                node = live[0]
                run, ids = node_run(keys, i, node, now, joined, c)
            else:
                # Only live candidates are measured: each one's run holds only its own entries.
                measured = [(node_run(keys, i, nd, now, joined, c), nd.node_id, nd) for nd in live]
                if prefer_tier is not None:
                    measured = in_tier(measured, prefer_tier)
                longest = max(len(r[0]) for r, _, _ in measured)
                tied = sorted((nid, r, nd) for r, nid, nd in measured if len(r[0]) == longest)
                if len(tied) == 1:
                    _, (run, ids), node = tied[0]
                else:
                    k = self._ties_broken % len(tied)
                    self._ties_broken += 1
                    if self._test_hooks is not None:
                        k = _hooked_tie(self._test_hooks, tied, k)
                    _, (run, ids), node = tied[k]
            chosen += run
            block_ids += ids
            runs.append((node.node_id, len(run)))
            i += len(run)
        hit = len(chosen)
        if hit == 0:
            return LookupOutcome(None, 0, [], [], b"", {})
        lock_id = f"{self._lock_prefix}-{next(self._lock_seq):x}"
        deadline = now + ttl
        nodes = {}
        pins: dict[str, list[bytes]] = {}
        start = 0
        for nid, count in runs:
            node = self.nodes[nid]
            node.locks.add(lock_id)
            nodes[nid] = node
            got = pins.get(nid)
            if got is None:
                pins[nid] = keys[start : start + count] if isinstance(keys, list) else list(keys[start : start + count])
            else:  # the same node again after another holder's run
                got += keys[start : start + count]
            start += count
        self.locks[lock_id] = Lock(lock_id, reader, deadline, pins, max(1, parties))
        heapq.heappush(self._lock_heap, (deadline, lock_id))
        c.hit_chunks += hit
        return LookupOutcome(
            lock_id,
            hit,
            runs,
            block_counts(chosen, runs, self.nodes),
            b"".join(block_ids),
            nodes,
        )

    def peek(self, keys: Sequence[bytes], now: float, skip: Mapping[str, int] | None = None,
             transport: str | None = None) -> PeekOutcome:
        """What ``lookup_and_lock`` with the same ``skip`` and ``transport`` would hit now, and
        how far each usable holder of key 0 holds the keys on its own (and, where its host tier
        holds some of them, how far its device tier does). Read-only: no lock, no pin, no lease
        or entry is changed (an expired node is left for the reaper)."""
        self.counters.peeks += 1
        return peek_prefixes(self.entries, self.nodes, keys, now, usable_filter(skip, transport))

    def live_nodes(self, now: float) -> list[Node]:
        """The registrations whose lease has not run out (read-only, like ``peek``)."""
        return [n for n in self.nodes.values() if n.expires_at > now]

    def release(self, lock_id: str, now: float, all_parties: bool = False) -> bool:
        """True if the lock was valid when this release arrived. The lock (and its pins) goes
        away with its last party's release, or at once with ``all_parties`` (a lock nobody reads
        under), or when it was no longer valid."""
        lock = self.locks.get(lock_id)
        if lock is None:
            self.counters.releases_expired += 1
            return False
        valid = now < lock.deadline
        lock.parties -= 1
        if all_parties or lock.parties <= 0 or not valid:
            del self.locks[lock_id]
            self._unpin(lock)
        if valid:
            self.counters.releases_ok += 1
        else:
            self.counters.releases_expired += 1
        return valid

    def _unpin(self, lock: Lock) -> None:
        lid = lock.lock_id
        for nid in lock.pins:
            node = self.nodes.get(nid)
            if node is not None:
                node.locks.discard(lid)

    # ---- housekeeping -------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Drop nodes whose lease ran out and forget locks past their deadline."""
        for nid in [nid for nid, n in self.nodes.items() if n.expires_at <= now]:
            self._drop_node(nid, "lease expired")
        self._reap_locks(now)

    def _reap_locks(self, now: float) -> None:
        heap = self._lock_heap
        while heap and heap[0][0] <= now:
            _, lid = heapq.heappop(heap)
            lock = self.locks.pop(lid, None)
            if lock is not None:  # None: released (or its node dropped) before its deadline
                self.counters.lock_expiries += 1
                self._unpin(lock)

    def clear(self) -> None:
        """Forget everything (a master that stops being leader must not serve stale state)."""
        for nid in list(self.nodes):
            self._drop_node(nid, "cleared")
        self.locks.clear()
        self._lock_heap.clear()

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        return {
            "nodes": len(self.nodes),
            "entries": self.n_entries,
            "held_blocks": self.held_blocks,
            "keys": len(self.entries),
            "locks": len(self.locks),
            "lookups": c.lookups,
            "peeks": c.peeks,
            "lookup_chunks": c.lookup_chunks,
            "hit_chunks": c.hit_chunks,
            "releases_ok": c.releases_ok,
            "releases_expired": c.releases_expired,
            "published": c.published,
            "publish_refused": c.publish_refused,
            "publish_fenced": c.publish_fenced,
            "unpublished": c.unpublished,
            "unpublish_refused": c.unpublish_refused,
            "nodes_expired": c.nodes_expired,
            "locks_invalidated": c.locks_invalidated,
            "lock_expiries": c.lock_expiries,
        }
