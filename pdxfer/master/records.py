"""What master calls return: a node's description, a chunk's location, a lookup's result."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NodeInfo:
    node_id: str
    rank: int
    transport: str
    transport_metadata: bytes
    layout: dict
    layout_fingerprint: str


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


@dataclass
class LookupResult:
    lock_id: str | None
    hit_chunks: int
    locations: list[ChunkLocation]
    nodes: dict[str, NodeInfo]
    lock_ttl_s: float
