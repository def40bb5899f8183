"""NodeSession: keeps one node registered with the master (lease heartbeats, re-registration)."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable

from pdxfer.master.client.master_client import MasterClient
from pdxfer.master.wire.errors import MasterError, RegistrationSuperseded
from pdxfer.master.wire.records import NodeInfo, Registration

log = logging.getLogger("pdxfer.master.client.master_client")


class NodeSession:
    """Keeps one node registered from a background thread.

    Heartbeats when a third of the lease has been used (i.e. on the *remaining* lease time, measured
    from when the last successful heartbeat was sent), retries quickly while the master is
    unreachable, and when the master says it forgot the node (failover, restart, lease lost)
    re-registers and calls ``on_reregistered()`` so the owner re-publishes what it holds.

    When the master says this registration was superseded (the node id was registered again,
    e.g. by a second process given the same id), it stops for good: no re-registration over the
    newer one, an ERROR log naming the node, ``superseded`` set and ``on_superseded()`` called so
    the owner stops serving as this node (its publishes would be refused anyway).

    The thread survives any error (logged once per kind, retried): ``healthy`` (the last call
    succeeded), ``last_error`` and ``last_ok_at`` are for the owner's /health.
    """

    def __init__(
        self,
        client: MasterClient,
        info: NodeInfo,
        lease_ttl_s: float = 10.0,
        on_reregistered: Callable[[], None] | None = None,
        on_superseded: Callable[[], None] | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        self.client = client
        self.info = info
        self.lease_ttl_s = lease_ttl_s
        self.on_reregistered = on_reregistered
        self.on_superseded = on_superseded
        self.superseded = False
        # Health, for the owner's /health: the last call's outcome. The thread never dies on an
        # error (issue 9, hole 10): a dead lease keeper would let the lease lapse silently.
        self.healthy = False
        self.last_error: BaseException | None = None
        self.last_ok_at: float | None = None  # monotonic time of the last successful heartbeat/registration
        self.registered = False
        self.reregistrations = 0
        self.registration: Registration | None = None  # the current one (epoch, master's bounds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def max_lock_ttl_s(self) -> float | None:
        """The master's cap on reader lock TTLs (None until registered): a refused unpublish may be
        retried as a force-free once this much time has passed since the lookup could have locked."""
        reg = self.registration
        return reg.max_lock_ttl_s if reg is not None else None

    def start(self) -> None:
        try:
            self.registration = self.client.register_node(self.info, self.lease_ttl_s)
            self.registered = True
            self._ok()
        except MasterError as exc:
            self.last_error = exc
            log.warning("node %s: first registration failed (%s); retrying in the background", self.info.node_id, exc)
        self._thread = threading.Thread(target=self._run, name=f"pdxfer-node-{self.info.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ttl = self.lease_ttl_s
        next_at = time.monotonic() + ttl / 3 if self.registered else time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            sent = time.monotonic()
            try:
                if self.registered and self.registration is not None:
                    if self.client.heartbeat(self.info.node_id, epoch=self.registration.epoch):
                        self._ok()
                        next_at = sent + ttl / 3
                        continue
                    log.warning("node %s: master forgot this node; re-registering", self.info.node_id)
                    self.registered = False
                self.registration = self.client.register_node(self.info, ttl)
                self.registered = True
                self.reregistrations += 1
                self._ok()
                next_at = sent + ttl / 3
                if self.on_reregistered is not None:
                    try:
                        self.on_reregistered()
                    except Exception:  # the owner's bug must not stop the lease keeper
                        log.exception("node %s: on_reregistered failed", self.info.node_id)
            except RegistrationSuperseded as exc:
                self._superseded(exc)
                return
            except MasterError as exc:
                log.debug("node %s: master unreachable: %s", self.info.node_id, exc)
                self._failed(exc)
                next_at = time.monotonic() + min(0.2, ttl / 10) * (0.5 + random.random())
            except Exception as exc:  # a bug or a library surprise: report it, keep the lease alive
                if self.healthy or type(exc) is not type(self.last_error):
                    log.exception("node %s: heartbeat failed unexpectedly; retrying", self.info.node_id)
                self._failed(exc)
                next_at = time.monotonic() + min(0.2, ttl / 10) * (0.5 + random.random())

    def _ok(self) -> None:
        self.healthy = True
        self.last_ok_at = time.monotonic()

    def _failed(self, exc: BaseException) -> None:
        self.healthy = False
        self.last_error = exc

    def _superseded(self, exc: RegistrationSuperseded) -> None:
        log.error("node %s: this registration was superseded by a newer registration of the same node id "
                  "(another process with this id?); stopping heartbeats and not re-registering: %s",
                  self.info.node_id, exc)
        self.superseded = True
        self.registered = False
        self._failed(exc)
        if self.on_superseded is not None:
            try:
                self.on_superseded()
            except Exception:  # the owner's bug must not hide the report above
                log.exception("node %s: on_superseded failed", self.info.node_id)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s * 3 + 1)
        reg = self.registration
        if deregister and self.registered and reg is not None:
            try:
                self.client.deregister_node(self.info.node_id, epoch=reg.epoch)
            except MasterError as exc:  # superseded included: the newer registration stays
                log.warning("node %s: deregister failed: %s", self.info.node_id, exc)
        self.registered = False

