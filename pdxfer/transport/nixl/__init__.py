"""NIXL transport (UCX backend): transport.py (the Transport), descriptors.py (region tables and
prepared descriptor lists), handle.py (read handles), metadata.py (what a holder exports),
env.py (the UCX environment rule and loading NIXL), progress.py (target-side progress).

Importing this package does not import NIXL itself: that happens when a transport is created
(or :func:`env.unavailable_reason` is asked), after the UCX environment is prepared.
"""

from pdxfer.transport.nixl.transport import NixlTransport

__all__ = ["NixlTransport"]
