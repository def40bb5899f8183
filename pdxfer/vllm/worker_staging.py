"""The worker's staging area for holders whose blocks differ from ours (see
:mod:`pdxfer.convert`): registered with the transport next to the KV regions, shared by
concurrent loads, a range given back only once no read can land in it any more.

A staged read (one holder rank's part of a load) is a :class:`StagedStream`: its holder blocks
are READ and scattered piece by piece, each piece as many holder blocks as there is room for
(at most half the area once the whole read does not fit, so concurrent loads get room too), the
next piece posted only once the previous one was scattered and its range freed. A load longer
than the whole area therefore still moves; only a single holder block larger than the area
cannot (:class:`StagingTooSmall`).

A failed load whose read never stopped (its transport broke its own bound) leaves its ranges
quarantined: out of use until the read stops, or a grace period after the worker disconnected
its holder, so a late byte of it can never land in the next load's staged bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdxfer import native
from pdxfer.convert import ConvertingPlanner, StagedRead, StagingArea, planner_for
from pdxfer.layout import KVLayout
from pdxfer.plan import PeerPlanner
from pdxfer.transport.base import ReadHandle, ReadState, RegisteredRegion

log = logging.getLogger("pdxfer.vllm.worker")

MiB = 1 << 20
# Headroom of the size chosen from the model: staged reads round out to whole holder blocks at
# both ends (holder blocks up to this many tokens), and a second load may convert meanwhile.
_ROUNDING_TOKENS = 1024
_MIN_AUTO_BYTES = 16 * MiB
# A quarantined range whose peer was disconnected is given back after this: bytes the transport
# was copying at the disconnect have landed by then.
QUARANTINE_GRACE_S = 2.0


class StagingFull(RuntimeError):
    """Concurrent converting loads used the whole staging area for longer than a load may wait."""


class StagingTooSmall(RuntimeError):
    """One holder block does not fit in the whole staging area: no piece can ever be staged."""


def auto_staging_bytes(layout: KVLayout, total_kv_heads: int, max_tokens: int, cap_mib: int) -> int:
    """Staging for one converting load of ``max_tokens`` (the model's max length) plus headroom,
    at most ``cap_mib`` MiB: longer loads stream through it in pieces. Per token, the worst case
    is staging whole holder blocks that carry every KV head of the model (a TP 1 holder in a
    format that interleaves heads, for a TP rank that keeps only some of them)."""
    per_token = layout.bytes_per_block / layout.block_size
    per_token *= max(1.0, total_kv_heads / max(1, layout.kv_heads))
    need = int(per_token * (max(0, max_tokens) + _ROUNDING_TOKENS) * 1.25)
    need = max(need, _MIN_AUTO_BYTES)
    return min(-(-need // MiB) * MiB, max(0, cap_mib) * MiB)


@dataclass(frozen=True)
class _Piece:
    """Arguments of ConvertingPlanner.read for one piece of a staged read."""

    remote_blocks: tuple[int, ...]
    remote_first_token: int
    local_blocks: tuple[int, ...]
    local_first_token: int
    start: int
    ntokens: int


@dataclass
class StagedStream:
    """One staged read: its holder blocks in order, the piece in staging now (``job``)."""

    planner: ConvertingPlanner
    peer: str  # the transport peer the pieces are read from
    read: Any  # the NodeRead
    pairs: bool  # block for block (no holder block size in the read)
    first: int  # index into read.remote_blocks of the first block with a token to move
    end: int  # one past the last such block
    next: int  # first block not yet staged
    job: StagedRead | None = None
    waiting_since: float = 0.0  # monotonic; 0: not waiting for room
    pieces: int = 0

    @property
    def finished(self) -> bool:
        return self.job is None and self.next >= self.end

    @property
    def unit(self) -> int:
        return self.planner.staging_bytes(1)

    def remaining_bytes(self) -> int:
        return self.planner.staging_bytes(self.end - self.next)

    def piece(self, a: int, b: int) -> _Piece:
        """Holder blocks [a, b) of the read, with the reader blocks their tokens go to."""
        r = self.read
        if self.pairs:
            return _Piece(tuple(r.remote_blocks[a:b]), 0, tuple(r.local_blocks[a:b]), 0, 0,
                          (b - a) * self.planner.local.block_size)
        hb, lb = self.planner.remote.block_size, self.planner.local.block_size
        t0 = max(r.start, r.remote_first_token + a * hb)
        t1 = min(r.start + r.num_tokens, r.remote_first_token + b * hb)
        la = (t0 - r.local_first_token) // lb
        le = -(-(t1 - r.local_first_token) // lb)
        return _Piece(tuple(r.remote_blocks[a:b]), r.remote_first_token + a * hb, tuple(r.local_blocks[la:le]),
                      r.local_first_token + la * lb, t0, t1 - t0)


@dataclass
class _Quarantined:
    offsets: list[int]
    handles: list[ReadHandle]
    since: float
    disconnected: bool  # the peers of every unstopped read were disconnected at ``since``
    what: str

    def releasable(self, now: float) -> bool:
        if all(_stopped(h) for h in self.handles):
            return True
        return self.disconnected and now - self.since >= QUARANTINE_GRACE_S


def _stopped(h: ReadHandle) -> bool:
    try:
        return h.poll() is not ReadState.PENDING
    except Exception:
        return False


def _check_not_empty(r: Any) -> None:
    # Refused before anything is reserved: only non-empty reads own a staging range.
    if not r.remote_blocks or not r.local_blocks:
        raise ValueError(f"a staged read from {r.node_id} names no holder blocks or no local blocks "
                         f"({len(r.remote_blocks)} and {len(r.local_blocks)})")


class ReaderStaging:
    def __init__(self, nbytes: int, layout: KVLayout) -> None:
        self.layout = layout
        self.region_index = len(layout.regions)
        # np.zeros maps lazily: untouched staging costs no memory.
        self._mem = np.zeros(max(nbytes, 0), dtype=np.uint8)
        self._buf = native.RawBuffer(self._mem.ctypes.data, self._mem.nbytes)
        self._regions = [native.RawBuffer(r.ptr, r.nbytes) for r in layout.regions]
        self.area = StagingArea(self._mem.nbytes)
        self._quarantine: list[_Quarantined] = []

    @property
    def enabled(self) -> bool:
        return self._mem.nbytes > 0

    @property
    def nbytes(self) -> int:
        return self._mem.nbytes

    def region(self) -> RegisteredRegion:
        return RegisteredRegion(self.region_index, self._mem.ctypes.data, self._mem.nbytes)

    def planner_for(self, remote: KVLayout, route: Any) -> PeerPlanner | ConvertingPlanner:
        """Checked once per holder rank at connect, for ``route``'s heads
        (:mod:`pdxfer.vllm.holder_routes`): straight into place where the bytes need no
        rearranging, else staged and converted (another block size, format or head arrangement)."""
        return planner_for(remote, self.layout, self.region_index if self.enabled else None,
                           src_head=route.src_head, dst_head=route.dst_head, nheads=route.nheads)

    # ------------------------------------------------------------------ streams

    def stream(self, planner: ConvertingPlanner, r: Any, peer: str) -> StagedStream:
        """A staged read of NodeRead ``r``: a token range when it names the holder's block size,
        else block-for-block pairs (another format or a head slice at the same block size).
        Nothing is reserved yet (:meth:`next_piece` does)."""
        _check_not_empty(r)
        if r.remote_block_size:
            if r.remote_block_size != planner.remote.block_size:
                raise ValueError(f"read from {r.node_id} says holder block size {r.remote_block_size}, "
                                 f"its layout {planner.remote.block_size}")
            hb = planner.remote.block_size
            if r.num_tokens <= 0 or r.start < r.remote_first_token:
                raise ValueError(f"read from {r.node_id}: tokens [{r.start}, {r.start + r.num_tokens}) do not "
                                 f"start in its holder blocks (from token {r.remote_first_token})")
            first = (r.start - r.remote_first_token) // hb
            end = min(len(r.remote_blocks), -(-(r.start + r.num_tokens - r.remote_first_token) // hb))
            s = StagedStream(planner, peer, r, False, first, end, first)
        else:
            if len(r.remote_blocks) != len(r.local_blocks):
                raise ValueError(f"read from {r.node_id}: {len(r.remote_blocks)} holder blocks for "
                                 f"{len(r.local_blocks)} local blocks")
            s = StagedStream(planner, peer, r, True, 0, len(r.remote_blocks), 0)
        if s.unit > self.nbytes:
            raise StagingTooSmall(f"one holder block of {r.node_id} stages {s.unit} bytes, more than the whole "
                                  f"staging area ({self.nbytes} bytes); raise staging_mib")
        return s

    def next_piece(self, s: StagedStream) -> StagedRead | None:
        """Reserve room for the stream's next piece and plan its READ; None while there is no room
        for even one holder block (other loads use the area: try again later)."""
        assert s.job is None and not s.finished
        left = s.end - s.next
        if s.remaining_bytes() > self.nbytes:  # streaming: leave room for other loads
            left = min(left, max(1, (self.nbytes // 2) // s.unit))
        got = self.area.alloc_upto(s.unit, left)
        if got is None:
            return None
        off, n = got
        p = s.piece(s.next, s.next + n)
        try:
            if s.pairs:
                job = s.planner.read_pairs(p.remote_blocks, p.local_blocks, off)
            else:
                job = s.planner.read(p.remote_blocks, p.remote_first_token, p.local_blocks, p.local_first_token,
                                     p.start, p.ntokens, off)
        except Exception:
            self.area.free(off)
            raise
        s.job, s.next, s.pieces = job, s.next + n, s.pieces + 1
        return job

    def scatter(self, s: StagedStream) -> None:
        """The stream's piece landed: copy its tokens into our blocks, then give its range back."""
        assert s.job is not None
        s.planner.scatter(s.job, self._buf, self._regions)
        self.area.free(s.job.staging_offset)
        s.job = None

    def release(self, streams: list[StagedStream]) -> None:
        """Only once no read of these streams can land any more."""
        for s in streams:
            if s.job is not None:
                self.area.free(s.job.staging_offset)
                s.job = None
        streams.clear()

    # ------------------------------------------------------------------ quarantine

    def quarantine(self, streams: list[StagedStream], handles: list[ReadHandle], disconnected: bool,
                   what: str) -> int:
        """Keep the ranges of reads that may still land out of use: until every one of
        ``handles`` stopped, or, where their peers were ``disconnected``, a grace period after.
        Returns the bytes kept out."""
        offsets = [s.job.staging_offset for s in streams if s.job is not None]
        held = sum(s.job.staging_bytes for s in streams if s.job is not None)
        for s in streams:
            s.job = None
        streams.clear()
        if offsets:
            self._quarantine.append(_Quarantined(offsets, list(handles), time.monotonic(), disconnected, what))
        return held

    def sweep(self) -> None:
        """Give back quarantined ranges no read can land in any more (called every step)."""
        if not self._quarantine:
            return
        now = time.monotonic()
        keep = []
        for q in self._quarantine:
            if q.releasable(now):
                for off in q.offsets:
                    self.area.free(off)
                log.info("pdxfer: staging range(s) of %s are in use again (%s)", q.what,
                         "its reads stopped" if all(_stopped(h) for h in q.handles)
                         else f"{QUARANTINE_GRACE_S:.0f} s after its holder was disconnected")
            else:
                keep.append(q)
        self._quarantine = keep

    @property
    def quarantined(self) -> int:
        """Quarantined ranges (loads' worth) still out of use."""
        return len(self._quarantine)
