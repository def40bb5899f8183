"""What the scheduler half tells the worker half each step, and what workers tell the scheduler
at start. Both cross a process boundary (vLLM pickles them), so both carry a version that the
receiver checks before trusting any field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:  # The connector needs vLLM's base classes; the core of pdxfer must import without vLLM.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata as _HandshakeBase,
        KVConnectorMetadata as _MetaBase,
        KVConnectorWorkerMetadata as _WorkerMetaBase,
    )
except ImportError:  # pragma: no cover - exercised only where vLLM is absent
    _HandshakeBase = object  # type: ignore[misc,assignment]
    _MetaBase = object  # type: ignore[misc,assignment]
    _WorkerMetaBase = object  # type: ignore[misc,assignment]

# What changed in each version (both halves check it before trusting a field):
#   1  loads (LoadSpec: reads per holder, lock, expiry, blocks) and holder refs; handshake
#   2  NodeRead carries a token range and the holder's block size for staged (converting) reads
#   3  tensor parallelism: HolderRef carries every rank's endpoint (transport metadata, layout)
#      and the holder's total KV heads; the handshake carries tp_size, total_kv_heads, dtype,
#      kv_format and block_size (each worker reads its own heads from the holder ranks)
#   4  LoadSpec carries looked_up_at (wall clock of the lookup) for the per-phase TTFT stats
#   5  each LoadSpec carries the holder descriptions its own lookup returned (``holders``); the
#      step-wide node map is gone: two loads of one step may name two registrations of one node
#   6  the step's number (``step_seq``) and the holder's write fence segment (``write_fence``):
#      workers report each step's KV writes complete there (pdxfer.vllm.write_fence)
#   7  HolderRef carries the registration's epoch; LoadSpec carries ``repull`` (RepullSpec): what a
#      worker needs to look a failed range up again and read it from another holder
#   8  host-memory tier: the step carries ``offloads`` (OffloadJob: device blocks -> host slots);
#      workers answer with PdxferWorkerMeta; the handshake carries the rank's host pool
#   9  hybrid models: LoadSpec carries ``groups`` (each KV cache group's kind and the reader
#      blocks the load fills in it); the handshake's layout names the groups (pdxfer.kv.groups)
METADATA_VERSION = 9


class MetadataVersionError(RuntimeError):
    """Scheduler and worker halves of different pdxfer versions were mixed in one engine."""


@dataclass(frozen=True)
class EndpointRef:
    """One rank of a holder engine: where to connect, and its KV layout (wire form)."""

    rank: int
    transport_metadata: bytes
    layout: dict[str, Any]


@dataclass(frozen=True)
class HolderRef:
    """Just enough about a holder engine for a worker to connect and plan: from the master's
    NodeInfo, every TP rank (``endpoints``, rank order)."""

    node_id: str
    transport: str
    endpoints: tuple[EndpointRef, ...]
    total_kv_heads: int = 0  # 0: not announced (see holder_routes.holder_total_heads)
    epoch: int = 0  # the registration the lookup named (0: unknown); a re-pull skips exactly it

    @property
    def tp_size(self) -> int:
        return len(self.endpoints)

    @property
    def transport_metadata(self) -> bytes:  # rank 0
        return self.endpoints[0].transport_metadata

    @property
    def layout(self) -> dict[str, Any]:  # rank 0
        return self.endpoints[0].layout

    def endpoint(self, rank: int) -> EndpointRef:
        ep = self.endpoints[rank]
        if ep.rank != rank:
            raise MetadataVersionError(f"holder {self.node_id}: endpoint {rank} says rank {ep.rank}")
        return ep

    @classmethod
    def of(cls, node: Any, epoch: int = 0) -> "HolderRef":
        """From a master NodeInfo (any object with its fields) and the lookup's epoch of it."""
        eps = tuple(EndpointRef(int(e.rank), bytes(e.transport_metadata), dict(e.layout)) for e in node.endpoints)
        return cls(node.node_id, node.transport, eps, int(getattr(node, "total_kv_heads", 0) or 0), int(epoch or 0))


@dataclass(frozen=True)
class NodeRead:
    """Copy ``remote_blocks[i]`` of ``node_id`` into local block ``local_blocks[i]``; or, when
    ``remote_block_size`` is set (the holder's blocks have another size), tokens
    ``[start, start + num_tokens)`` from holder blocks starting at token ``remote_first_token``
    into local blocks starting at token ``local_first_token``."""

    node_id: str
    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    remote_block_size: int = 0  # 0: the reader's own block size, block for block
    remote_first_token: int = 0
    local_first_token: int = 0
    start: int = 0
    num_tokens: int = 0


@dataclass(frozen=True)
class RepullSpec:
    """What a worker needs to look a load's range up again, excluding the holders that failed
    it, and plan the reads from another holder (:mod:`pdxfer.vllm.worker.repull`)."""

    reader: str  # the reader id the lookups are made under
    keys: tuple[bytes, ...]  # the hit's keys, chunk ``first_chunk`` on (the tail key last when tail_tokens)
    first_chunk: int
    tail_tokens: int
    chunk_tokens: int
    start: int  # this load fills tokens [start, end)
    end: int
    block_ids: tuple[int, ...]  # the request's block table, at least up to ``end``
    skip: tuple[tuple[str, int], ...] = ()  # holders (node, epoch) the scheduler's lookup ruled out
    lock_ttl_s: float = 10.0


@dataclass(frozen=True)
class LoadSpec:
    req_id: str
    lock_id: str
    num_tokens: int  # tokens these reads provide (for stats and logs)
    reads: tuple[NodeRead, ...]
    lock_expires_at: float  # wall clock; the worker skips a read that cannot finish in time
    # Every local block vLLM expects this load to fill: reported as load errors if anything
    # fails, even when no read could be planned (else vLLM would compute on garbage KV).
    blocks: tuple[int, ...] = ()
    looked_up_at: float = 0.0  # wall clock when the scheduler's lookup answered; 0: unknown
    # The description of every holder the reads name, as this load's own lookup returned it (a
    # node re-registered by a new process between two lookups has two descriptions in one step).
    holders: tuple[HolderRef, ...] = ()
    repull: RepullSpec | None = None  # None: a failed read is recomputed, never re-pulled
    # A hybrid model's load: (group kind, reader blocks it fills in that group) per KV cache
    # group, in group order; empty for one full-attention group.
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def local_blocks(self) -> set[int]:
        return set(self.blocks) | {b for r in self.reads for b in r.local_blocks}

    def holder(self, node_id: str) -> HolderRef:
        """The description of ``node_id`` this load's reads must use."""
        for h in self.holders:
            if h.node_id == node_id:
                return h
        raise MetadataVersionError(f"load of {self.req_id} names node {node_id} that it does not describe")


@dataclass(frozen=True)
class OffloadJob:
    """Copy device block ``device_blocks[i]`` into host slot ``host_slots[i]`` (every layer and
    segment). Sent in a step after the one that wrote those blocks."""

    job_id: int
    device_blocks: tuple[int, ...]
    host_slots: tuple[int, ...]


@dataclass
class PdxferWorkerMeta(_WorkerMetaBase):  # type: ignore[misc]
    """Worker -> scheduler, per step (vLLM aggregates every rank's before the scheduler sees it):
    offload jobs whose copy completed on a rank (job id -> ranks done) or failed (job id -> why)."""

    offloads_done: dict[int, int] = field(default_factory=dict)
    offloads_failed: dict[int, str] = field(default_factory=dict)
    version: int = METADATA_VERSION

    def aggregate(self, other: "PdxferWorkerMeta") -> "PdxferWorkerMeta":
        if getattr(other, "version", None) != self.version:
            raise MetadataVersionError(f"worker metadata versions {self.version} and "
                                       f"{getattr(other, 'version', None)} in one engine: mixed pdxfer installs?")
        done = dict(self.offloads_done)
        for job, n in other.offloads_done.items():
            done[job] = done.get(job, 0) + n
        return PdxferWorkerMeta(done, {**self.offloads_failed, **other.offloads_failed}, self.version)


@dataclass
class PdxferConnectorMetadata(_MetaBase):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    offloads: list[OffloadJob] = field(default_factory=list)
    step_seq: int = 0  # 1, 2, ... per built step; 0: this scheduler has no write fence
    write_fence: str = ""  # shared-memory name where workers store completed step numbers
    version: int = METADATA_VERSION

    def check(self) -> None:
        if self.version != METADATA_VERSION:
            raise MetadataVersionError(f"connector metadata version {self.version}, this worker "
                                       f"speaks {METADATA_VERSION}: mixed pdxfer installs?")
        for spec in self.loads:
            if len({h.node_id for h in spec.holders}) != len(spec.holders):
                raise MetadataVersionError(f"load of {spec.req_id} describes one node twice")
            for r in spec.reads:
                spec.holder(r.node_id)


@dataclass
class PdxferHandshake(_HandshakeBase):  # type: ignore[misc]
    """Worker -> scheduler at engine start: one TP rank's endpoint and what its KV is; the
    scheduler registers one node per engine with every rank's endpoint."""

    node_id: str
    rank: int  # TP rank
    transport: str
    transport_metadata: bytes
    layout: dict[str, Any]
    layout_fingerprint: str
    tp_size: int = 1
    total_kv_heads: int = 0
    dtype: str = ""
    kv_format: str = ""
    block_size: int = 0
    host_blocks: int = 0  # host-tier slots of this rank (0: none); their layout is in ``layout``
    version: int = METADATA_VERSION

    def check(self) -> None:
        if self.version != METADATA_VERSION:
            raise MetadataVersionError(f"worker handshake version {self.version}, scheduler "
                                       f"speaks {METADATA_VERSION}: mixed pdxfer installs?")
