"""Which tier of its holder a chunk location is in, from what the holder registered.

A holder with a host tier registers a layout that carries ``HOST_LAYOUT_KEY`` and publishes its
host slots as block ids from its device block count (the layout's ``num_blocks``) on: slot s is
block ``num_blocks + s``. A location's tier is therefore known from its block ids alone, at the
master as at the reader, with nothing added to an entry.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

DEVICE_TIER = "device"  # the engine's KV cache blocks
HOST_TIER = "host"  # the holder's host-memory pool
TIERS = (DEVICE_TIER, HOST_TIER)
# The key under which a rank's layout (wire form) carries its host pool's layout: readers that
# predate the tier ignore it (and read no host ids: those are outside their device layout).
HOST_LAYOUT_KEY = "host_tier"


def host_block_base(layout: Mapping[str, Any]) -> int | None:
    """The first host block id of a holder with this registered layout; None without a host tier
    (or a layout that does not say its block count)."""
    if HOST_LAYOUT_KEY not in layout:
        return None
    n = layout.get("num_blocks")
    return n if type(n) is int and n >= 0 else None


def tier_of(block_ids: Sequence[int], host_base: int | None) -> str:
    """The tier a location with ``block_ids`` is in, for a holder whose host ids start at
    ``host_base`` (None: it has no host tier)."""
    if host_base is None or not block_ids:
        return DEVICE_TIER
    return HOST_TIER if max(block_ids) >= host_base else DEVICE_TIER
