"""What the master needs from its store beyond the in-memory index: leadership and a membership
mirror. Standalone (the default) is always leader and mirrors nothing; the etcd coordinator
(``pdxfer.master.etcd_store``) elects a leader among replicas and keeps node keys under leases.

The hot path never waits on a coordinator: membership calls only queue work.
"""

from __future__ import annotations

from typing import Any, Callable


class Standalone:
    kind = "memory"

    def __init__(self) -> None:
        self.on_become_leader: Callable[[], None] | None = None
        self.on_lose_leader: Callable[[], None] | None = None

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def degraded(self) -> str | None:
        """None when healthy, else why the master runs from memory only."""
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
