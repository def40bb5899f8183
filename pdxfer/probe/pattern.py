"""Deterministic byte patterns and transfer plans shared by the probe and the conformance tests.

Both sides of a transfer derive the same bytes from (region, seed), so a reader can check every
byte it received without the holder sending a reference copy.
"""

from __future__ import annotations

import numpy as np

from pdxfer.transport.plan import TransferPlan, TransferRun

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def pattern(region: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` uint8 whose value at offset i depends on (region, seed, i // 8) and i % 8."""
    return pattern_at(region, 0, nbytes, seed)


def pattern_at(region: int, offset: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """Bytes ``[offset, offset + nbytes)`` of :func:`pattern` without computing the rest."""
    first = offset // 8
    words = (offset + nbytes + 7) // 8 - first
    w = np.arange(first, first + words, dtype=np.uint64)
    w *= _GOLDEN
    w ^= np.uint64(((region + 1) * 0x100000001B3 + seed * 0x51ED27) & 0xFFFFFFFFFFFFFFFF)
    w ^= w >> np.uint64(29)
    skip = offset - first * 8
    return w.view(np.uint8)[skip:skip + nbytes]


def fill(buf: np.ndarray, region: int, seed: int = 0) -> None:
    """Write the pattern of ``region`` into a uint8 buffer in place."""
    buf[:] = pattern(region, buf.nbytes, seed)


def scattered_plan(block: int, batch: int, remote_size: int, local_size: int, seed: int = 0,
                   remote_region: int = 0, local_region: int = 0) -> TransferPlan:
    """``batch`` runs of ``block`` bytes from shuffled remote slots into shuffled local slots.

    Slots are block-aligned and distinct on each side, so no two runs overlap and runs are
    almost never adjacent on both sides (which would let a transport coalesce them).
    """
    if block <= 0 or batch <= 0:
        raise ValueError(f"block and batch must be positive, got {block}, {batch}")
    rslots, lslots = remote_size // block, local_size // block
    if batch > rslots or batch > lslots:
        raise ValueError(f"{batch} x {block} B does not fit remote {remote_size} B / local {local_size} B")
    rng = np.random.default_rng(seed)
    if batch == 1:
        ra, la = [0], [0]
    else:
        ra = rng.permutation(rslots)[:batch].tolist()
        la = rng.permutation(lslots)[:batch].tolist()
    runs = tuple(TransferRun(remote_region, a * block, local_region, b * block, block) for a, b in zip(ra, la))
    return TransferPlan(runs, batch)


def mismatches(plan: TransferPlan, local: dict[int, np.ndarray], remote_sizes: dict[int, int],
               seed: int = 0) -> list[str]:
    """Runs whose local bytes differ from the holder's pattern (empty list: all exact)."""
    cache: dict[int, np.ndarray] = {}
    # Whole-region patterns pay off only when the plan covers a good part of the region.
    whole = plan.total_bytes * 4 >= sum(remote_sizes.values())
    bad = []
    for i, r in enumerate(plan.runs):
        if not whole:
            want = pattern_at(r.remote_region, r.remote_offset, r.nbytes, seed)
        else:
            if r.remote_region not in cache:
                cache[r.remote_region] = pattern(r.remote_region, remote_sizes[r.remote_region], seed)
            want = cache[r.remote_region][r.remote_offset:r.remote_offset + r.nbytes]
        got = local[r.local_region][r.local_offset:r.local_offset + r.nbytes]
        if not np.array_equal(want, got):
            first = int(np.argmax(want != got))
            bad.append(f"run {i} ({r}): first difference at byte {first}")
    return bad
