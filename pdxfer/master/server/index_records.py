"""The records the chunk index (index.py) keeps: nodes, entries, locks, counters, and what a
lookup returns. Plain data with slots: millions of entries live in memory at once."""

from __future__ import annotations

from dataclasses import dataclass, field


class UnknownNodeError(KeyError):
    """The node id is not registered (never was, deregistered, or its lease ran out)."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)
        self.node_id = node_id

    def __str__(self) -> str:
        return f"node {self.node_id!r} is not registered (unknown, deregistered, or its lease expired)"


class SupersededError(KeyError):
    """A call names a registration of the node that a newer registration (same node id, maybe
    another process) has replaced: it must not be applied to the newer one (issue 9, hole 2)."""

    def __init__(self, node_id: str, epoch: int, current: int) -> None:
        super().__init__(node_id)
        self.node_id, self.epoch, self.current = node_id, epoch, current

    def __str__(self) -> str:
        return (f"registration {self.epoch:#x} of node {self.node_id!r} was superseded by registration "
                f"{self.current:#x} (the node id was registered again, by another process or a restart)")


class FencedError(ValueError):
    """A publish whose sequence number the holder had fenced: it gave up on it (issue 9, hole 1)."""

    def __init__(self, node_id: str, seq: int, fence: int) -> None:
        super().__init__(node_id)
        self.node_id, self.seq, self.fence = node_id, seq, fence

    def __str__(self) -> str:
        return (f"publish seq {self.seq} of node {self.node_id!r} is at or below its fence {self.fence}: "
                "the holder gave up on it, nothing of it was applied")


class Node:
    __slots__ = ("node_id", "info_json", "ttl", "expires_at", "epoch", "entries", "locks", "fence_seq",
                 "transport", "hold_floor", "per", "held_blocks", "host_base")

    def __init__(self, node_id: str, info_json: str, ttl: float, expires_at: float, epoch: int,
                 transport: str | None = None, host_base: int | None = None) -> None:
        self.node_id = node_id
        self.transport = transport  # what it serves over; None: not said (a reader's filter lets it by)
        # Its first host-tier block id (pdxfer.kv.tiers); None: it has no host tier.
        self.host_base = host_base
        self.info_json = info_json  # pre-encoded JSON object sent with every lookup that hits it
        self.ttl = ttl
        self.expires_at = expires_at
        self.epoch = epoch
        self.entries: dict[bytes, Entry] = {}
        self.locks: set[str] = set()
        # Publishes with seq <= this are refused: the holder gave up on them (and may have freed
        # their blocks). Per registration: a new registration starts with a new Node.
        self.fence_seq = 0
        # Bounds that let a lookup skip a per-entry pass (index.py): no entry of the node is held
        # for less than hold_floor, and every entry has ``per`` block ids (-1: not all the same;
        # -2: no entry yet). Both only ever loosen, so a stale value costs speed, never truth.
        self.hold_floor = float("inf")
        self.per = -2
        # Sum of nblocks over ``entries``, kept as they change: a scrape or status must not walk
        # millions of entries.
        self.held_blocks = 0


class Entry:
    __slots__ = ("node", "blocks", "nblocks", "hold_until", "run", "pos")

    def __init__(self, node: Node, blocks: bytes, hold_until: float) -> None:
        self.node = node
        self.blocks = blocks  # little-endian uint32 block ids, in token order
        self.nblocks = len(blocks) // 4
        self.hold_until = hold_until
        # The publish that last set this entry, and the entry's place in it (see PublishedRun).
        self.run: PublishedRun | None = None
        self.pos = 0


class PublishedRun:
    """The entries one publish call set on a node, in the order it named them, with their keys
    joined. A reader asks for a prompt's chunks in the order its holder published them, so a
    lookup can check a whole span of a run with one comparison of key bytes and take its entries
    with one list slice, instead of a dict lookup per key.

    The run stands for its entries only while it is intact (``live == len(entries)``): every one
    of them is still in its node under its key, unchanged since this publish. Removing an entry or
    setting it again (a later publish) takes it out of the run and breaks the run for good."""

    __slots__ = ("keys", "entries", "hold_until", "live", "blocks", "stride")

    def __init__(self, keys: bytes, entries: list[Entry], hold_until: float) -> None:
        self.keys = keys  # the entries' keys, joined (32 bytes each)
        self.entries = entries
        self.hold_until = hold_until  # every entry's, as one publish sets one retention
        self.live = len(entries)
        # The entries' block ids, joined, so a span's ids are one slice too (joining them per
        # lookup cost a third of the master's time on a 512-chunk hit). ``stride``: bytes per
        # entry, which every entry but the last has (a prompt's tail chunk has fewer blocks);
        # 0 when they differ, and a span's ids are then joined when asked for.
        self.blocks = b"".join([e.blocks for e in entries])
        stride = entries[0].nblocks * 4 if entries else 0
        self.stride = stride if all(e.nblocks * 4 == stride for e in entries[:-1]) else 0

    def block_span(self, pos: int, m: int) -> bytes:
        """The block ids of entries[pos:pos + m], joined."""
        stride = self.stride
        if not stride:
            return b"".join([e.blocks for e in self.entries[pos : pos + m]])
        end = len(self.blocks) if pos + m == len(self.entries) else (pos + m) * stride
        return self.blocks[pos * stride : end]

    @staticmethod
    def leave(entry: Entry) -> None:
        """``entry`` is removed or set again: its run no longer stands for it, nor for the others.

        A broken run is never read again, so it lets go of everything at once: otherwise one
        surviving entry of a 512-chunk publish would keep the 511 removed entries, their keys and
        block ids alive, counted by neither ``max_entries`` nor the held blocks."""
        run = entry.run
        if run is None:
            return
        entry.run = None
        for other in run.entries:
            other.run = None
        run.entries, run.keys, run.blocks, run.live = [], b"", b"", -1


@dataclass
class Lock:
    lock_id: str
    reader: str
    deadline: float
    # The keys this lock pins, per node. An entry is pinned while a lock that is still valid names
    # its key on its node: the lookup pays for one list slice per holder instead of a counter
    # update per entry, and the rare questions ("may this entry go?") ask the node's few locks.
    pins: dict[str, list[bytes]]
    # Releases still expected: a TP reader's ranks each read their heads under the one lock and
    # each release it; the pins stay until the last one (or the deadline).
    parties: int = 1


@dataclass
class LookupOutcome:
    lock_id: str | None
    hit: int
    runs: list[tuple[str, int]]  # (node id, number of consecutive chunks taken from it)
    counts: list[int]  # blocks per hit chunk
    blocks: bytes  # concatenated uint32 block ids of all hit chunks
    nodes: dict[str, Node]


@dataclass
class PeekOutcome:
    hit: int
    prefix_by_node: dict[str, int]  # node id -> leading keys it holds contiguously from key 0 (> 0)
    nodes: dict[str, Node]  # the nodes in prefix_by_node
    # node id -> how many of those leading keys it holds in its device tier (KV cache), for the
    # nodes where that is fewer (their host tier holds the rest); absent: all of them
    device_prefix_by_node: dict[str, int] = field(default_factory=dict)


@dataclass
class Counters:
    lookups: int = 0
    peeks: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    releases_ok: int = 0
    releases_expired: int = 0
    published: int = 0
    publish_refused: int = 0
    publish_fenced: int = 0
    unpublished: int = 0
    unpublish_refused: int = 0
    nodes_expired: int = 0
    locks_invalidated: int = 0
    lock_expiries: int = 0  # locks reaped at their deadline with releases still missing
    span_chunks: int = 0  # chunks a lookup measured as spans of published runs (index_reads.node_run)
