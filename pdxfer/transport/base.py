"""The interface every pdxfer transport implements.

A holder registers its KV regions and exports metadata bytes; a reader connects to a peer from
those bytes and posts batched READs of a :class:`~pdxfer.kv.layout.TransferPlan` (offsets are
region-relative; each transport maps region indices to what its wire needs). Reads are
asynchronous: ``read`` returns a handle that is polled or waited on with a bound.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from pdxfer.transport.plan import TransferPlan


class TransportError(RuntimeError):
    """Base of every transport failure; the message names the peer and the cause."""


class PeerUnreachable(TransportError):
    """Could not connect to (or handshake with) the peer."""


class PeerDied(TransportError):
    """The peer went away while a read was in flight."""


class RegionUnknown(TransportError):
    """A plan names a region index the peer (or this side) never registered."""


class OutOfRange(TransportError):
    """A run reaches outside a registered region."""


class TransferTimeout(TransportError):
    """A bounded wait ran out."""


class TransferCancelled(TransportError):
    """The read was cancelled by the caller."""


class MetadataError(TransportError):
    """Peer metadata is malformed, from another transport kind or another wire version."""


class ReadState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class RegisteredRegion:
    """A memory region as the transport sees it: its index in the layout, address and size.

    ``tensor``: for device memory (``device`` "cuda:N"), the region's bytes as a flat uint8 tensor
    (:func:`pdxfer.device.flat_bytes`, sliced to the region). Transports that cannot reach device
    memory by address (TCP) copy through it with :mod:`pdxfer.device`; host regions leave it None.
    It takes no part in equality or hashing.
    """

    index: int
    ptr: int
    nbytes: int
    device: str = "cpu"
    tensor: Any = field(default=None, compare=False, repr=False)


class ReadHandle(abc.ABC):
    """One posted read. ``wait`` never blocks longer than its timeout."""

    @abc.abstractmethod
    def poll(self) -> ReadState:
        """Non-blocking; FAILED means ``error`` says why."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> ReadState:
        """Block up to ``timeout`` seconds; raises TransferTimeout when still pending, or the typed
        error of a failed read."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the read; bytes already landed in local memory must be treated as garbage."""

    @property
    @abc.abstractmethod
    def error(self) -> TransportError | None: ...


class Transport(abc.ABC):
    kind: str = "abstract"

    @abc.abstractmethod
    def register(self, regions: Sequence[RegisteredRegion]) -> None:
        """Register memory once at start. Index i of the layout must be region i here."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Bytes a peer passes to ``connect``: versioned, carrying kind and region table."""

    @abc.abstractmethod
    def connect(self, peer_metadata: bytes, timeout: float = 5.0) -> str:
        """Connect to a peer (idempotent); returns the peer id used by ``read``."""

    @abc.abstractmethod
    def read(self, peer: str, plan: TransferPlan) -> ReadHandle:
        """Post a batched READ: remote runs of ``peer`` into this side's registered regions."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None: ...

    @abc.abstractmethod
    def deregister(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (in-flight reads fail with TransferCancelled). Idempotent."""

    def guard_counts(self) -> dict[str, int]:
        """Since start, what unauthenticated peers cost this holder, by kind (a transport that
        authenticates its peers itself reports them; others: none)."""
        return {}

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
