"""HA coordination through etcd (``aetcd``): leader election, leader address, node membership.

- Election: ``<prefix>/leader`` is created only if absent (txn on version == 0) under this
  replica's lease; its value is ``{"addr": ADVERTISE, "id": REPLICA_ID}`` (key names and value
  encoding: ``etcd_layout.py``, shared with the clients that read it). Standbys poll for the
  key to disappear (the leader's lease ran out or it stepped down) and then race to create it.
- Renewal: the leader refreshes its lease whenever a third of the TTL has passed since the last
  *successful* refresh was sent (i.e. on the remaining time, with two more chances before expiry),
  never "half the TTL after grant".
- Membership: the leader mirrors each registered node as ``<prefix>/nodes/<id>`` under a per-node
  etcd lease (refreshed on heartbeats, revoked on deregister/drop). The in-memory index stays the
  authority for the hot path; etcd writes are queued and never block a request.
- etcd unreachable: the leader keeps serving from memory and reports ``degraded``, but only while
  its lease cannot have expired by its own clock: from the send time of the last successful
  keepalive plus the lease TTL minus a margin (``lease_margin``). Past that a standby may hold the
  key, so it stops serving (``is_leader`` is False at once: requests get "not leader"), then steps
  down (clearing its index) and campaigns again when etcd answers (issue 9, hole 4). Measuring from
  the *send* time is conservative: etcd starts the TTL when it receives the request, later.
- TLS and etcd auth (``etcd_security.py``): the client opens a TLS channel and authenticates as
  the configured user (``etcd_grpc.py``). A refusal (certificate not trusted or not accepted, wrong
  password, no permission on the prefix) is reported like an outage - the replica cannot lead or
  keeps leading only while its lease lasts - but ``degraded`` and the log say what was refused.
  Each endpoint is tried in turn; a member that is down is skipped on the next round.
- After a failover the new leader starts empty; nodes find out through ``heartbeat -> False``,
  re-register and re-publish what they hold (``NodeSession`` does this).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Any, Callable

import aetcd

from pdxfer.master.backends import etcd_layout
from pdxfer.master.backends.etcd_grpc import SecureEtcdClient, explain_rpc_error
from pdxfer.master.backends.etcd_security import EtcdRefused
from pdxfer.master.backends.coordinator import Members
log = logging.getLogger("pdxfer.master.etcd")

_POLL_S = 0.2  # standby poll and membership sync cadence


class EtcdCoordinator:
    kind = "etcd"

    def __init__(self, target: etcd_layout.EtcdTarget, leader_ttl: float = 5.0, timeout_s: float = 1.0) -> None:
        self.endpoints = list(target.endpoints)
        self.prefix = target.prefix
        self.security = target.security
        # etcd leases have whole-second TTLs.
        self.leader_ttl = max(1, math.ceil(leader_ttl))
        self.timeout_s = timeout_s
        self.replica_id = uuid.uuid4().hex[:12]
        self.advertise = ""
        self.on_become_leader: Callable[[], None] | None = None
        self.on_lose_leader: Callable[[], None] | None = None
        self._leader = False
        self._leader_addr: str | None = None
        self._degraded: str | None = None
        self._refused: str | None = None  # the last refusal logged (logged once per distinct reason)
        self._client: aetcd.Client | None = None
        self._ep_index = 0
        self._lease: Any = None
        self._lease_sent = 0.0  # when the last successful refresh (or the grant) was sent
        self._lease_ttl = float(self.leader_ttl)
        self._stale_lease: Any = None  # our lease after a clock step-down: re-adopted if etcd kept it
        self._task: asyncio.Task[None] | None = None
        # membership mirror
        self._pending: dict[str, tuple[str, float, str]] = {}  # node id -> ("put", ttl, json) | ("del", 0, "")
        self._touched: set[str] = set()
        self._node_leases: dict[str, tuple[Any, float, float]] = {}  # id -> (lease, ttl, last refresh)
        self.failovers = 0
        self.members: Members | None = None
        self.leader_key = etcd_layout.leader_key(self.prefix)

    # ---- what the service reads -----------------------------------------------------------------

    @staticmethod
    def lease_margin(ttl: float) -> float:
        """How long before its lease could run out (by our clock) a leader stops serving: covers
        clock-rate differences and a standby's poll. A quarter of the TTL, at most 1 s."""
        return min(ttl / 4, 1.0)

    def _lease_may_have_expired(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now >= self._lease_sent + self._lease_ttl - self.lease_margin(self._lease_ttl)

    @property
    def is_leader(self) -> bool:
        # Checked on every request: the background loop may sit in a stuck etcd call meanwhile.
        return self._leader and not self._lease_may_have_expired()

    @property
    def degraded(self) -> str | None:
        return self._degraded

    @property
    def leader_address(self) -> str | None:
        if self._leader:
            return None if self._lease_may_have_expired() else self.advertise
        return self._leader_addr

    def status(self) -> dict[str, Any]:
        return {
            "store": self.kind,
            "leader": self.is_leader,
            "leader_address": self.leader_address,
            "degraded": self._degraded,
            "replica_id": self.replica_id,
            "etcd": "%s:%d" % self.endpoints[self._ep_index],
        }

    # ---- membership (queued; never blocks the caller) -------------------------------------------

    def node_registered(self, node_id: str, ttl: float, info_json: str) -> None:
        if self._leader:
            self._pending[node_id] = ("put", ttl, info_json)

    def node_heartbeat(self, node_id: str) -> None:
        if self._leader:
            self._touched.add(node_id)

    def node_dropped(self, node_id: str) -> None:
        if self._leader:
            self._pending[node_id] = ("del", 0.0, "")
            self._touched.discard(node_id)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, advertise: str) -> None:
        self.advertise = advertise
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._leader and self._lease is not None:
            # Step down promptly so a standby does not wait for the lease to run out.
            try:
                await self._revoke(self._lease)
            except Exception as exc:
                log.warning("could not revoke the leader lease on shutdown: %s", exc)
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.close(), self.timeout_s)
            except Exception:
                pass

    async def _call(self, coro: Any) -> Any:
        # aetcd's own timeout covers the gRPC call; this bounds everything else around it too.
        return await asyncio.wait_for(coro, self.timeout_s * 2)

    # A lease object calls etcd through the client that granted it, whose channel may lead to a
    # member that has since died: renew and revoke through the current client instead.
    async def _refresh(self, lease: Any) -> Any:
        client = await self._connect()
        return await self._call(client.refresh_lease(lease.id))

    async def _revoke(self, lease: Any) -> Any:
        client = await self._connect()
        return await self._call(client.revoke_lease(lease.id))

    async def _connect(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._ep_index]
            client = SecureEtcdClient(host, port, self.security, self.timeout_s)
            await self._call(client.connect())
            self._client = client
        return self._client

    async def _reset_client(self) -> None:
        client, self._client = self._client, None
        if len(self.endpoints) > 1:
            self._ep_index = (self._ep_index + 1) % len(self.endpoints)
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.timeout_s)
            except Exception:
                pass

    async def _run(self) -> None:
        while True:
            try:
                client = await self._connect()
                if self._leader:
                    await self._keep_leadership(client)
                else:
                    await self._campaign(client)
                if self._leader:
                    await self._sync_members(client)
                if self._degraded is not None:
                    log.warning("etcd reachable again; no longer degraded")
                    if self._leader:
                        # Node leases may have run out in etcd meanwhile: write members again.
                        self._node_leases.clear()
                        self._remirror_all()
                self._degraded = self._refused = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = self._reason(exc)
                if reason.startswith("etcd refused") and reason != self._refused:
                    log.error("%s", reason)
                    self._refused = reason
                elif self._degraded is None:
                    log.warning("%s; %s", reason, "serving from memory while the leader lease lasts"
                                if self._leader else "standby waits")
                self._degraded = reason
                await self._reset_client()
            if self._leader and self._lease_may_have_expired():
                # Already refusing requests (is_leader); now forget what we knew: another replica
                # may lead, and holders may have moved to it and freed blocks.
                self._stale_lease = self._lease
                self._step_down(f"leader lease may have expired: no successful keepalive for "
                                f"{time.monotonic() - self._lease_sent:.1f} s (lease ttl {self._lease_ttl:.0f} s)",
                                None)
            await asyncio.sleep(_POLL_S if not self._leader else min(_POLL_S, self._lease_ttl / 6))

    async def _create_leader_key(self, client: aetcd.Client, lease: Any) -> bool:
        """Create the leader key under ``lease`` only if nobody holds it (one txn)."""
        tx = client.transactions
        ok, _ = await self._call(client.transaction(
            compare=[tx.version(self.leader_key) == 0],
            success=[tx.put(self.leader_key, etcd_layout.encode_leader(self.advertise, self.replica_id), lease)],
            failure=[],
        ))
        return bool(ok)

    async def _take_leader_key(self, client: aetcd.Client) -> bool:
        """Create the leader key under a fresh lease if nobody holds it; on success adopt the lease."""
        sent = time.monotonic()  # before the grant: etcd's TTL starts later than this, never earlier
        lease = await self._call(client.lease(self.leader_ttl))
        if not await self._create_leader_key(client, lease):
            await self._revoke(lease)
            return False
        self._lease, self._lease_sent, self._lease_ttl = lease, sent, float(lease.ttl or self.leader_ttl)
        return True

    async def _campaign(self, client: aetcd.Client) -> None:
        got = await self._call(client.get(self.leader_key))
        if got is not None:
            if self._holds_key(got) and await self._readopt_stale_lease():
                pass  # our key under our lease survived the outage: nobody else led meanwhile
            else:
                self._leader_addr = _addr_of(got)
                return
        elif not await self._take_leader_key(client):
            return
        self._leader = True
        self._leader_addr = self.advertise
        self.failovers += 1
        self._node_leases.clear()
        log.info("became leader (replica %s, lease ttl %ds, advertising %s)", self.replica_id, self.leader_ttl,
                 self.advertise)
        if self.on_become_leader is not None:
            self.on_become_leader()

    async def _readopt_stale_lease(self) -> bool:
        """After a clock step-down: if etcd still keeps our lease, lead again under it (with the
        empty index the step-down left) instead of waiting for it to run out."""
        lease, self._stale_lease = self._stale_lease, None
        if lease is None:
            return False
        sent = time.monotonic()
        reply = await self._refresh(lease)
        ttl = getattr(reply, "TTL", 0) if reply is not None else 0
        if ttl <= 0:
            return False
        self._lease, self._lease_sent, self._lease_ttl = lease, sent, float(ttl)
        return True

    async def _keep_leadership(self, client: aetcd.Client) -> None:
        now = time.monotonic()
        if now - self._lease_sent < self._lease_ttl / 3:
            # Not due for renewal: still check (one cheap get per round) that the key is ours,
            # so a replica that lost the key stops serving within a poll interval.
            got = await self._call(client.get(self.leader_key))
            if self._holds_key(got):
                return
        sent = time.monotonic()
        reply = await self._refresh(self._lease)
        ttl = getattr(reply, "TTL", 0) if reply is not None else 0
        if ttl > 0:
            self._lease_sent, self._lease_ttl = sent, float(ttl)
            got = await self._call(client.get(self.leader_key))
            if self._holds_key(got):
                return
            if got is None:
                # Our lease lives but the key is gone (deleted by hand): re-create it under the lease.
                if await self._create_leader_key(client, self._lease):
                    return
                got = await self._call(client.get(self.leader_key))
            self._step_down("another replica holds the leader key", _addr_of(got))
            return
        # Our lease is gone (expired while etcd was unreachable, or revoked). Try to take the key
        # back; if somebody else has it, step down.
        got = await self._call(client.get(self.leader_key))
        if got is None:
            if await self._take_leader_key(client):
                log.warning("leader lease had expired; re-acquired leadership, re-mirroring nodes")
                self._node_leases.clear()
                self._remirror_all()
                return
            got = await self._call(client.get(self.leader_key))
        self._step_down("leader lease lost", _addr_of(got))

    def _remirror_all(self) -> None:
        # Set by the service: current members to write again after losing our etcd state.
        provider = self.members
        if provider is None:
            return
        for node_id, ttl, info_json in provider():
            self._pending[node_id] = ("put", ttl, info_json)

    def _step_down(self, why: str, new_leader: str | None) -> None:
        log.warning("stepping down: %s (leader now %s)", why, new_leader)
        self._leader = False
        self._leader_addr = new_leader
        self._lease = None
        self._pending.clear()
        self._touched.clear()
        self._node_leases.clear()
        if self.on_lose_leader is not None:
            self.on_lose_leader()

    async def _sync_members(self, client: aetcd.Client) -> None:
        # Take the queue first; anything that fails goes back for the next round.
        pending, self._pending = self._pending, {}
        touched, self._touched = self._touched, set()
        try:
            for node_id, (op, ttl, info_json) in list(pending.items()):
                old = self._node_leases.pop(node_id, None)
                if old is not None:
                    await self._revoke(old[0])
                if op == "put":
                    lease = await self._call(client.lease(max(1, math.ceil(ttl))))
                    await self._call(client.put(etcd_layout.node_key(self.prefix, node_id), info_json.encode(), lease))
                    self._node_leases[node_id] = (lease, ttl, time.monotonic())
                else:
                    await self._call(client.delete(etcd_layout.node_key(self.prefix, node_id)))
                del pending[node_id]
            now = time.monotonic()
            for node_id in list(touched):
                held = self._node_leases.get(node_id)
                if held is not None and now - held[2] >= held[1] / 3:
                    await self._refresh(held[0])
                    self._node_leases[node_id] = (held[0], held[1], now)
                touched.discard(node_id)
        finally:
            for node_id, v in pending.items():
                self._pending.setdefault(node_id, v)
            self._touched |= touched

    def _reason(self, exc: Exception) -> str:
        """What ``degraded`` says: the refusal in words when etcd refused us, else the error."""
        if isinstance(exc, EtcdRefused):
            return f"etcd refused: {exc}"[:500]
        host, port = self.endpoints[self._ep_index]
        why = explain_rpc_error(f"{host}:{port}", exc, self.security)
        if why is not None and "invalid auth token" in why:
            # etcd forgot our token (it restarted, or the token aged out): the next connect
            # authenticates again; nothing to fix.
            return f"etcd unreachable: auth token no longer valid at {host}:{port}; authenticating again"
        if why is not None:
            return f"etcd refused: {why}"[:500]
        return f"etcd unreachable: {type(exc).__name__}: {exc}"[:300]

    def _holds_key(self, got: Any) -> bool:
        """Whether a get of the leader key found this replica's record."""
        record = _record_of(got)
        return record is not None and record.replica_id == self.replica_id


def _record_of(got: Any) -> etcd_layout.LeaderRecord | None:
    """The leader record of a get result (None: no key, or a value that is no leader record)."""
    if got is None:
        return None
    try:
        return etcd_layout.decode_leader(got.value)
    except ValueError:
        return None


def _addr_of(got: Any) -> str | None:
    record = _record_of(got)
    return record.addr if record is not None else None
