"""How the chunk index's lookups and peeks read what candidate holders hold, without changing the
index. Here: the reader's filter on candidates, a holder's run of the asked keys (whole spans of its
published runs where it can), that run cut to one tier, its device-tier prefix, and peek's walk.

Called by the chunk index (index.py) from its single-threaded lookups and peeks only, on its own
dicts: a node's lease is checked by the caller, and nothing here changes an entry, a node or a
lock (``node_run`` counts the chunks it read as spans, nothing more).
"""

from __future__ import annotations

import operator
from typing import Callable, Mapping, Sequence

from pdxfer.kv.keys import KEY_BYTES
from pdxfer.kv.tiers import DEVICE_TIER, tier_of
from pdxfer.master.server.index_records import Counters, Entry, Node, PeekOutcome
from pdxfer.master.wire.protocol import unpack_u32_array

_NBLOCKS = operator.attrgetter("nblocks")
_BLOCKS = operator.attrgetter("blocks")
_HOLD = operator.attrgetter("hold_until")
# What node_run picks on one node: its entries, and their block ids joined in pieces.
Picked = tuple[list[Entry], list[bytes]]


def usable_filter(skip: Mapping[str, int] | None, transport: str | None) -> Callable[[Node], bool] | None:
    """The reader's filter on candidate holders; None when it rules nothing out (the hot path
    then pays nothing for it)."""
    if not skip and transport is None:
        return None
    skip = skip or {}

    def usable(node: Node) -> bool:
        if transport is not None and node.transport is not None and node.transport != transport:
            return False
        e = skip.get(node.node_id)
        return e is None or (e != 0 and e != node.epoch)

    return usable


def joined_keys(keys: Sequence[bytes], joined: bytes | None, spans: bool) -> bytes | None:
    """The keys joined, if spans are read and every key is KEY_BYTES long (else None)."""
    if not spans:
        return None
    if joined is None:
        joined = b"".join(keys)
        if set(map(len, keys)) - {KEY_BYTES}:
            return None
    if len(joined) != KEY_BYTES * len(keys):
        raise ValueError(f"joined keys hold {len(joined)} bytes, not {KEY_BYTES} for each of {len(keys)} keys")
    return joined


def node_run(keys: Sequence[bytes], start: int, node: Node, now: float, joined: bytes | None,
             counters: Counters) -> Picked:
    """The node's entries for keys[start:] up to its first miss or entry past retention (its
    lease was checked by the caller), and their block ids joined in pieces. Where the keys
    follow one of the node's intact published runs (and ``joined`` is given), a span of it is
    taken whole: one comparison of key bytes, one list slice, one slice of block ids. The rest
    is read in growing windows, so a short run costs little and a long one is a few C-speed
    maps."""
    get = node.entries.get
    out: list[Entry] = []
    ids: list[bytes] = []
    n = len(keys)
    j = start
    while joined is not None and j < n:
        e = get(keys[j])
        if e is None:
            return out, ids
        r = e.run
        # Intact: every entry of r is still the node's entry under its key, unchanged, held
        # until r.hold_until. So equal keys mean these very entries, all within retention.
        if r is None or r.live != len(r.entries) or r.hold_until <= now:
            break
        pos = e.pos
        m = min(n - j, len(r.entries) - pos)
        if joined[j * KEY_BYTES : (j + m) * KEY_BYTES] != r.keys[pos * KEY_BYTES : (pos + m) * KEY_BYTES]:
            break  # the keys leave the run somewhere in this span: read it key by key
        out += r.entries[pos : pos + m]
        ids.append(r.block_span(pos, m))
        j += m
        counters.span_chunks += m
    width = 64
    while j < n:
        window = list(map(get, keys[j : j + width]))
        try:
            end = window.index(None)
        except ValueError:
            end = len(window)
        if end and node.hold_floor <= now and min(map(_HOLD, window[:end])) <= now:  # some entry's retention is over
            end = next(k for k in range(end) if window[k].hold_until <= now)
        out += window[:end]
        ids.append(b"".join(map(_BLOCKS, window[:end])))
        if end < len(window):
            break
        j += end
        width *= 8
    return out, ids


def in_tier(measured: list[tuple[Picked, str, Node]], tier: str) -> list[tuple[Picked, str, Node]]:
    """The candidates whose run starts in ``tier``, each run cut where it leaves the tier;
    all of them unchanged when none does (the chunk is not held in that tier)."""
    out = []
    for picked, nid, nd in measured:
        run = picked[0]
        base = nd.host_base
        if base is None:
            n = len(run) if tier == DEVICE_TIER else 0
        else:
            n = 0
            for e in run:
                if tier_of(unpack_u32_array(e.blocks), base) != tier:
                    break
                n += 1
        if n == len(run):
            out.append((picked, nid, nd))
        elif n:
            out.append(((run[:n], [b"".join(map(_BLOCKS, run[:n]))]), nid, nd))
    return out or measured


def device_run(keys: Sequence[bytes], n: int, node: Node) -> int:
    """How many of ``keys[:n]`` (all held by ``node``) it holds in its device tier, from key 0."""
    base = node.host_base
    for i in range(n):
        e = node.entries.get(keys[i])
        if e is None or tier_of(unpack_u32_array(e.blocks), base) != DEVICE_TIER:
            return i
    return n


def block_counts(chosen: list[Entry], runs: list[tuple[str, int]], nodes: Mapping[str, Node]) -> list[int]:
    """Block ids per chosen entry; a node whose entries all have the same count is not asked
    entry by entry."""
    if len(runs) == 1:
        per = nodes[runs[0][0]].per
        if per >= 0:
            return [per] * len(chosen)
    return list(map(_NBLOCKS, chosen))


def peek_prefixes(entries: Mapping[bytes, Mapping[str, Entry]], nodes: Mapping[str, Node], keys: Sequence[bytes],
                  now: float, usable: Callable[[Node], bool] | None) -> PeekOutcome:
    """The walk of ``ChunkIndex.peek``: how many leading ``keys`` some live usable holder holds,
    how far each usable holder of key 0 holds them on its own, and, where its device tier holds
    fewer of those, how many. ``entries`` and ``nodes``: the index's; ``usable``: from
    ``usable_filter``."""
    prefix: dict[str, int] = {}
    active: list[str] = []  # usable nodes that hold every key so far
    hit = 0
    for i, key in enumerate(keys):
        holders = entries.get(key)
        if holders is None:
            break
        if active:
            # Node leases and the filter do not change within one call: only the entry's
            # retention is left to check for nodes that passed them at key 0.
            still = []
            for nid in active:
                e = holders.get(nid)
                if e is not None and e.hold_until > now:
                    still.append(nid)
                else:
                    prefix[nid] = i
            active = still
            if still:
                hit += 1
                continue
        live = [nid for nid, e in holders.items() if e.hold_until > now and e.node.expires_at > now
                and (usable is None or usable(e.node))]
        if not live:
            break
        if i == 0:
            active = live
        hit += 1
    for nid in active:
        prefix[nid] = hit
    device: dict[str, int] = {}
    for nid, n in prefix.items():
        node = nodes[nid]
        if node.host_base is not None:
            d = device_run(keys, n, node)
            if d < n:
                device[nid] = d
    return PeekOutcome(hit, prefix, {nid: nodes[nid] for nid in prefix}, device)
