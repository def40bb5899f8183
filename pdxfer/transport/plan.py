"""A transfer plan: the byte runs ``(remote region, offset) -> (local region, offset, nbytes)`` one
read moves, in region-relative offsets, so it is independent of where either side mapped its
memory; each transport turns region indices into whatever its wire needs. Runs that are adjacent
on both sides are coalesced (:func:`coalesce`), which is what keeps descriptor counts (the limit
NixlConnector hits) low when vLLM hands out consecutive blocks. Who builds plans from KV blocks is
:mod:`pdxfer.planning`; this module knows nothing of blocks or chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class TransferRun:
    remote_region: int
    remote_offset: int
    local_region: int
    local_offset: int
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    runs: tuple[TransferRun, ...]
    uncoalesced_runs: int

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.runs)

    def __len__(self) -> int:
        return len(self.runs)


def coalesce(runs: Iterable[TransferRun]) -> list[TransferRun]:
    """Merge each run into the previous one when both sides continue exactly where it ended."""
    out: list[TransferRun] = []
    for r in runs:
        if out:
            p = out[-1]
            if (p.remote_region == r.remote_region and p.local_region == r.local_region
                    and p.remote_offset + p.nbytes == r.remote_offset
                    and p.local_offset + p.nbytes == r.local_offset):
                out[-1] = TransferRun(p.remote_region, p.remote_offset, p.local_region, p.local_offset,
                                      p.nbytes + r.nbytes)
                continue
        out.append(r)
    return out
