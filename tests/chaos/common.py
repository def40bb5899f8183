"""What the chaos processes share: the run config, block stamps, chunk keys, the JSON-lines op log,
control files, and fd/thread counts for the leak check.

A block's bytes are ``stamp (24 bytes) + body``: the stamp names (holder index, incarnation,
block id, generation) with a CRC, and the body is BLAKE3-XOF of the stamp, so a reader can tell
from the bytes alone which generation it saw and whether the block was torn (header of one
generation, body of another) while it was read.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
import numpy as np

STAMP = struct.Struct("<IHHIQ")  # magic, holder index, incarnation, block id, generation (+ crc32)
STAMP_BYTES = STAMP.size + 4
MAGIC = 0x5A43484B


@dataclass
class ChaosConfig:
    """One run. Every process gets the same JSON copy; seeds make the random choices repeatable."""

    seed: int = 1
    duration_s: float = 40.0
    holders: int = 3
    readers: int = 3
    blocks: int = 48  # per holder
    block_bytes: int = 4096
    prompts: int = 6
    chunks: int = 6  # chunks per prompt (one block each)
    transport: str = "tcp"
    ha: bool = False
    master_timeout_s: float = 1.0
    lease_ttl_s: float = 2.0
    lock_ttl_s: float = 2.0  # readers' normal lock TTL (and what holders assume)
    retention_s: tuple[float, float] = (0.5, 3.0)
    short_ttl_p: float = 0.08  # a reader picks a lock TTL shorter than its read
    sleep_past_ttl_p: float = 0.04  # a reader sleeps past its TTL before release
    read_timeout_s: float = 2.0
    io_timeout_s: float = 2.0
    stale_floor_s: float = 60.0  # the real holder's floor for "never confirmed unpublished"
    unsafe_free: bool = False  # deliberately broken holder: frees published blocks early
    # A holder moves a held chunk to a copy in its host blocks (ids blocks.., as the real holder
    # publishes host slots after its device blocks) with this probability per loop turn;
    # unsafe_move frees the old block even when the master refused the move (a reader's lock pins
    # it): the checker must find stale reads.
    move_p: float = 0.15
    host_blocks: int = 24  # per holder
    unsafe_move: bool = False
    # A device block a move freed is rewritten for another key and published at once, as a busy
    # holder reuses it sooner or later: a reader still locked on that old location (a move the
    # master should have refused) then reads another key's bytes for certain, not by chance.
    reuse_at_once: bool = False
    faults: list[str] = field(default_factory=list)  # kinds to inject ([] = all for the variant)
    fault_gap_s: tuple[float, float] = (0.3, 1.2)
    # Below master_timeout_s a request always lands before its call gives up; beyond it a call can
    # time out on the client and still arrive (issue 9 hole 1: test_hole1_late_publish_after_free).
    link_delay_s: tuple[float, float] = (0.02, 0.8)
    long_ttl_p: float = 0.0  # a slow reader: takes long_ttl_s locks and reads late (hole 6)
    long_ttl_s: float = 30.0
    long_ttl_sleep_s: float = 5.0
    op_gap_s: tuple[float, float] = (0.002, 0.02)
    # Heterogeneous holders and readers (tests/chaos/kv.py): real KV caches of several formats and
    # block sizes, loads planned and run by pdxfer's connector halves, checked token by token.
    kv: bool = False
    # Heterogeneous holders and readers next to the stamped ones (kv=False): holder indexes
    # holders.. and reader indexes readers.. run tests/chaos/kv_*.py in the same cluster.
    kv_holders: int = 0
    kv_readers: int = 0
    chunk_tokens: int = 64  # kv mode: smaller than one holder's block, larger than another's
    staging_mib: int = 4  # kv mode: each reader's staging area for converting reads
    # kv mode, a deliberately broken reader: groups one holder's chunk locations as if their
    # blocks continued each other (issue 16 hole 1), so the checker must find wrong KV.
    broken_grouping: bool = False
    broken_repull: bool = False  # readers re-pull one block late (tests.chaos.kv_reader): must be caught
    wait_slack_s: float = 1.5  # scheduling slack on a loaded 2-core machine
    # A node-id clash's second process sleeps this long before it registers: a loaded machine's
    # slow start, made repeatable.
    dup_start_delay_s: float = 0.0
    workdir: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChaosConfig:
        doc = json.loads(text)
        for k in ("retention_s", "fault_gap_s", "op_gap_s", "link_delay_s"):
            doc[k] = tuple(doc[k])
        return cls(**doc)

    def max_lock_ttl(self) -> float:
        return self.lock_ttl_s

    def holder_is_kv(self, holder: int) -> bool:
        """Whether holder index ``holder`` (a node-id clash's second process is 100 + the index it
        clashes with) is a heterogeneous one."""
        return self.kv or holder % 100 >= self.holders

    def reader_is_kv(self, reader: int) -> bool:
        return self.kv or reader >= self.readers


def node_id_of(holder: int) -> str:
    return f"h{holder}"


def key_name(prompt: int, chunk: int) -> str:
    return f"{prompt}.{chunk}"


def key_bytes(name: str) -> bytes:
    return blake3.blake3(f"pdxfer-chaos-{name}".encode()).digest()


def stamp_of(holder: int, inc: int, block: int, gen: int) -> bytes:
    head = STAMP.pack(MAGIC, holder, inc, block, gen)
    return head + struct.pack("<I", zlib.crc32(head))


def body_of(stamp: bytes, nbytes: int) -> bytes:
    return blake3.blake3(stamp).digest(length=nbytes)


def write_block(pool: np.ndarray, block: int, stamp: bytes) -> None:
    """Rewrite one block: body first, stamp last (a reader racing us sees a mismatch either way)."""
    row = pool[block]
    row[STAMP_BYTES:] = np.frombuffer(body_of(stamp, row.nbytes - STAMP_BYTES), dtype=np.uint8)
    row[:STAMP_BYTES] = np.frombuffer(stamp, dtype=np.uint8)


def decode_block(data: bytes) -> dict[str, Any]:
    """What a reader saw: the stamp's fields (None when there is no valid stamp), whether the body
    belongs to that stamp, and a short digest of all bytes."""
    out: dict[str, Any] = {"digest": blake3.blake3(data).hexdigest(length=8), "stamp": None, "ok": False}
    head, crc = data[:STAMP.size], data[STAMP.size:STAMP_BYTES]
    magic, holder, inc, block, gen = STAMP.unpack(head)
    if magic != MAGIC or struct.unpack("<I", crc)[0] != zlib.crc32(head):
        return out
    out["stamp"] = [holder, inc, block, gen]
    out["ok"] = data[STAMP_BYTES:] == body_of(data[:STAMP_BYTES], len(data) - STAMP_BYTES)
    return out


class OpLog:
    """One JSON object per line, flushed per record: a SIGKILLed process leaves a readable log."""

    def __init__(self, path: str, proc: str) -> None:
        self.proc = proc
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole process
        self._lock = threading.Lock()

    def write(self, op: str, **fields: Any) -> None:
        rec = {"op": op, "proc": self.proc, "wall": time.time(), "mono": time.monotonic(), **fields}
        line = json.dumps(rec, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        self._f.close()


class Timed:
    """Start/end times of one operation (monotonic for durations, wall for merging logs)."""

    def __init__(self) -> None:
        self.t0, self.w0 = time.monotonic(), time.time()

    def fields(self) -> dict[str, float]:
        t1 = time.monotonic()
        return {"t0": self.w0, "t1": self.w0 + (t1 - self.t0), "dur": t1 - self.t0}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settle_threads(baseline: int, timeout_s: float = 3.0) -> int:
    """Thread count once background threads had a bounded chance to finish."""
    deadline = time.monotonic() + timeout_s
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def ctl(workdir: str, name: str) -> bool:
    """Control files the harness creates: ``stop`` (end of the run), ``exit`` (leave now)."""
    return os.path.exists(os.path.join(workdir, "ctl", name))


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a chaos process never outlives the harness, even if it is SIGKILLed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
