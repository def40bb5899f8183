"""What the master needs beyond its in-memory index: leadership among replicas and a mirror of
node membership. ``Coordinator`` is the interface the service uses;
``pdxfer.master.backends.choice.coordinator_for(url)`` picks the backend by the URL's scheme:

    none / ""                        Standalone: one process, always leader, mirrors nothing
    etcd://HOST:PORT[,...]/PREFIX    EtcdCoordinator (etcd_coordinator.py): elected leader,
                                     membership keys under leases, degraded mode

The hot path never waits on a coordinator: membership calls only queue work.
A new backend: a class with this interface (in a module of its own, importing this one) and one
branch in ``coordinator_for``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

# (node id, lease ttl, the node's description JSON) of every registered node.
Members = Callable[[], list[tuple[str, float, str]]]


class Coordinator(Protocol):
    kind: str  # reported as "store" in stats and /health
    # Set by the service before start():
    on_become_leader: Callable[[], None] | None
    on_lose_leader: Callable[[], None] | None  # the service then forgets its index
    members: Members | None  # current members, to mirror again after the backend lost them

    @property
    def is_leader(self) -> bool: ...

    @property
    def degraded(self) -> str | None:
        """None when healthy, else why the master runs from memory only."""

    @property
    def leader_address(self) -> str | None: ...

    async def start(self, advertise: str) -> None: ...

    async def stop(self) -> None: ...

    def node_registered(self, node_id: str, ttl: float, info_json: str) -> None: ...

    def node_heartbeat(self, node_id: str) -> None: ...

    def node_dropped(self, node_id: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


class Standalone:
    kind = "memory"

    def __init__(self) -> None:
        self.on_become_leader: Callable[[], None] | None = None
        self.on_lose_leader: Callable[[], None] | None = None
        self.members: Members | None = None

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def degraded(self) -> str | None:
        return None

    @property
    def leader_address(self) -> str | None:
        return None

    async def start(self, advertise: str) -> None:
        if self.on_become_leader is not None:
            self.on_become_leader()

    async def stop(self) -> None:
        return None

    def node_registered(self, node_id: str, ttl: float, info_json: str) -> None:
        return None

    def node_heartbeat(self, node_id: str) -> None:
        return None

    def node_dropped(self, node_id: str) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"store": self.kind, "leader": True, "degraded": None}
