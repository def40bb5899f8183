"""What master calls return: a node's description, a chunk's location, a lookup's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class RankEndpoint:
    """Where one tensor-parallel rank of a node serves its KV: its transport metadata and the
    layout of its (per-rank) KV tensors."""

    rank: int
    transport_metadata: bytes
    layout: dict
    layout_fingerprint: str


@dataclass
class NodeInfo:
    """One holder engine. The flat fields describe rank 0 (as before protocol 3); a TP engine
    registers once with every rank's endpoint in ``more_ranks`` (ranks 1 .. tp_size - 1)."""

    node_id: str
    rank: int
    transport: str
    transport_metadata: bytes
    layout: dict
    layout_fingerprint: str
    tp_size: int = 1
    total_kv_heads: int = 0  # 0: not announced (then rank 0's layout's kv_heads x tp_size)
    more_ranks: tuple[RankEndpoint, ...] = ()
    # What a router needs to send requests to the engine and to ask the index about its prompts
    # (all optional: "" / 0 mean not announced, as from a registration that predates them).
    serve_url: str = ""  # the engine's OpenAI-compatible HTTP base URL, e.g. "http://10.0.0.5:8100"
    namespace: str = ""  # hex of the engine's key namespace root (pdxfer.kv.keys.Namespace.root())
    chunk_tokens: int = 0  # tokens per chunk key
    role: str = ""  # "kv_producer" | "kv_consumer" | "kv_both"

    @property
    def endpoints(self) -> tuple[RankEndpoint, ...]:
        """Every rank's endpoint, rank 0 first."""
        first = RankEndpoint(self.rank, self.transport_metadata, self.layout, self.layout_fingerprint)
        return (first, *self.more_ranks)

    def endpoint(self, rank: int) -> RankEndpoint:
        for ep in self.endpoints:
            if ep.rank == rank:
                return ep
        raise KeyError(f"node {self.node_id} has no rank {rank} (TP size {self.tp_size})")


@dataclass(frozen=True)
class Registration:
    """What a register call returns: the registration's epoch (named by every later call of the
    node) and the bounds the master enforces, which the holder derives its timers from."""

    node_id: str
    epoch: int
    lease_ttl_s: float
    max_lock_ttl_s: float  # no reader lock on this node's entries outlives this (issue 9, hole 6)


@dataclass(slots=True)
class ChunkLocation:
    key: bytes
    node_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class PeekResult:
    """What a read-only peek says about some keys: nothing is locked or pinned, so by the time a
    reader looks up the same keys, holders may have come or gone."""

    hit: int  # leading chunks the live fleet holds: what lookup_and_lock would hit now
    # node id -> how many leading keys (from key 0) that node alone holds contiguously; live,
    # usable holders only, and only those holding key 0 (every value > 0)
    prefix_by_node: dict[str, int]
    nodes: dict[str, NodeInfo]  # descriptions of the nodes in prefix_by_node
    # node id -> how many of its leading keys its device tier (KV cache) holds: fewer than in
    # prefix_by_node where its host tier holds the rest; what its own prefix cache can hit
    device_prefix_by_node: dict[str, int] = field(default_factory=dict)


@dataclass
class LookupResult:
    lock_id: str | None
    hit_chunks: int
    locations: Sequence[ChunkLocation]  # a list, or the client's lazily built equivalent
    nodes: dict[str, NodeInfo]
    lock_ttl_s: float
    # The registration (epoch) of each holder in ``nodes``: what a reader names in a later
    # lookup's ``skip`` when it cannot read that holder.
    epochs: dict[str, int] = field(default_factory=dict)
