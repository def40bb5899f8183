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
