"""Which coordinator a ``--coordinator`` URL names (``coordinator_for``): the one module that knows
every backend, so each backend imports the interface (coordinator.py) and nothing imports back."""

from __future__ import annotations

from pdxfer.master.backends.coordinator import Coordinator, Standalone


def coordinator_for(url: str | None, leader_ttl: float = 5.0, timeout_s: float = 1.0) -> Coordinator:
    """The backend a URL names. ValueError naming the URL when its scheme or form is wrong,
    ImportError when the backend's client library is missing."""
    if not url:
        return Standalone()
    from pdxfer.master.backends import etcd_layout

    if url.startswith(etcd_layout.SCHEME):
        target = etcd_layout.parse_etcd_url(url)
        from pdxfer.master.backends.etcd_coordinator import EtcdCoordinator  # needs aetcd: only when asked for

        return EtcdCoordinator(target, leader_ttl, timeout_s)
    raise ValueError(f"coordinator URL {url!r}: unknown scheme (none for standalone, or {etcd_layout.SCHEME}...)")
