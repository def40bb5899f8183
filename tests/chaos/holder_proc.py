"""A chaos holder: a block pool registered with a real transport, published through the real
master client under a real NodeSession, freed only by the rules the real holder
(pdxfer/vllm/scheduler/holder.py) follows.

  python -m tests.chaos.holder_proc --config CFG --holder H --node-id ID --inc N --log FILE --master ADDR

Rules (same as the real holder): a published block is held; blocks come back only for keys
``unpublish_if_unlocked`` returns (it fences every publish queued so far, so none can land
later), after lease + the master's lock TTL cap without any master answer (heartbeats included),
or past ``max(10 x that cap, stale floor)`` never confirmed. A publish carries the sequence
number and registration it was queued under; a timed-out or refused one is left to the fenced
unpublish (kept held); a fenced one is sent again for what is still held. ``--unsafe-free`` (config.unsafe_free)
breaks the rule on purpose: it reuses published blocks before unpublishing them, so the checker
must find stale reads.

Moves (``move_p``) re-point a held key at a copy in one of the holder's host blocks, the way the
real holder moves a chunk to its host tier: the copy is written first, every publish numbered so far is
fenced, the new location is published, and the old block is freed only once the master accepted;
a reader's lock on the old location makes the master refuse, and both blocks stay held.
``--unsafe-move`` (config.unsafe_move) frees the old block after a refusal too. With
``reuse_at_once`` a block a move freed is rewritten for another key and published right away, so
a reader still locked on it (after a refusal the broken holder ignored) reads another key for certain.

Once stopped, a holder logs ``drained`` when it holds nothing any more: the harness's quiet
period ends on that, not on a fixed wait.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdxfer.master import (
    MasterClient,
    MasterError,
    MasterUnavailable,
    NodeInfo,
    NodeSession,
    PublishFenced,
)
from pdxfer.transport import create_transport
from pdxfer.transport.base import RegisteredRegion
from tests.chaos.common import (
    ChaosConfig,
    OpLog,
    Timed,
    ctl,
    die_with_parent,
    key_bytes,
    key_name,
    open_fds,
    settle_threads,
    stamp_of,
    write_block,
)


@dataclass
class Held:
    block: Any  # one block id; a tuple of them in the heterogeneous holder (tests/chaos/kv_holder.py)
    gen: int
    retain_until: float  # monotonic
    retention_end: float = 0.0  # when retention first ran out
    early_free_at: float = 0.0  # unsafe mode only
    spare: list[int] = field(default_factory=list)  # a move's copy, until its answer says which block is served


class Holder:
    MOVES = True  # the heterogeneous holder's chunks are pattern-written KV: it does not move them

    def __init__(self, cfg: ChaosConfig, holder: int, node_id: str, inc: int, log: OpLog, master: str) -> None:
        self.cfg, self.holder, self.node_id, self.inc, self.log = cfg, holder, node_id, inc, log
        self.rng = random.Random(cfg.seed * 1000003 + holder * 7919 + inc)
        self.held: dict[str, Held] = {}
        self.lock = threading.Lock()  # the session thread re-publishes from held
        # A move's fence + publish and a re-publish never interleave: a re-publish of the old
        # block numbered after the fence could otherwise land after the move and point at a freed block.
        self.pub_lock = threading.Lock()
        self.gen = 0
        self.unreachable_since: float | None = None
        self.superseded = False
        self.transport = create_transport(cfg.transport, **({"io_timeout": cfg.io_timeout_s}
                                                            if cfg.transport == "tcp" else {}))
        info = self._memory(node_id)
        # Two clients like the real holder: publishes on one path, session and reaper on another.
        self.hot = MasterClient(master, timeout_s=cfg.master_timeout_s)
        self.bg = MasterClient(master, timeout_s=cfg.master_timeout_s)
        self.session = NodeSession(self.bg, info, lease_ttl_s=cfg.lease_ttl_s, on_reregistered=self.republish,
                                   on_superseded=self._on_superseded)

    def _memory(self, node_id: str) -> NodeInfo:
        """The block pool, registered with the transport; what the node registers at the master."""
        cfg = self.cfg
        # Device blocks first, then the host blocks that moves copy chunks to (one region, like
        # the real holder's "device block count + slot" ids).
        self.pool = np.zeros((cfg.blocks + cfg.host_blocks, cfg.block_bytes), dtype=np.uint8)
        self.free = list(range(cfg.blocks))
        self.host_free = list(range(cfg.blocks, cfg.blocks + cfg.host_blocks))
        self.transport.register([RegisteredRegion(0, self.pool.ctypes.data, self.pool.nbytes)])
        return NodeInfo(node_id, 0, cfg.transport, self.transport.metadata(),
                        {"v": 1, "block_size": 16, "chaos_holder": self.holder}, "chaos-fp")

    def key(self, name: str) -> bytes:
        return key_bytes(name)

    @staticmethod
    def blocks_of(b: Any) -> list[int]:
        """An entry's blocks: one per chunk here (an int), a list in the heterogeneous holder."""
        return list(b) if isinstance(b, (list, tuple)) else [b]

    def _on_superseded(self) -> None:
        """Another process registered our node id: the master dropped our entries and the locks
        on them with it, and refuses our calls from now on. Publish nothing more, free it all."""
        self.superseded = True
        self.log.write("superseded", node=self.node_id, held=len(self.held))
        with self.lock:
            self._release_locked(list(self.held), "superseded")

    @property
    def max_lock_ttl(self) -> float:
        """The master's cap on reader locks (from the registration), not our own readers' TTL."""
        reg = self.hot.registration(self.node_id)
        return float(reg.max_lock_ttl_s) if reg is not None else 3600.0

    @property
    def stale_after(self) -> float:
        return max(10 * self.max_lock_ttl, self.cfg.stale_floor_s)

    # ---- ops ------------------------------------------------------------------------------------

    def publish(self) -> None:
        if self.superseded:
            return
        p = self.rng.randrange(self.cfg.prompts)
        n = self.rng.randint(1, self.cfg.chunks)
        now = time.monotonic()
        retain = self.rng.uniform(*self.cfg.retention_s)
        with self.lock:
            entries, new = self._take_blocks(p, n, now, retain)
        if not entries:
            return
        self._send_publish(entries, new, retain)

    def _take_blocks(self, p: int, n: int, now: float, retain: float) -> tuple[list[tuple[str, Any, int]], list[str]]:
        """Under the lock: the first n chunks of prompt p, held ones refreshed, new ones written
        into free blocks (and logged before their publish leaves)."""
        entries: list[tuple[str, Any, int]] = []
        new: list[str] = []
        for i in range(n):
            name = key_name(p, i)
            h = self.held.get(name)
            if h is not None:  # wanted again: refresh with the block already held
                h.retain_until, h.retention_end = now + retain, 0.0
                entries.append((name, h.block, h.gen))
                continue
            if not self.free:
                break
            b = self.free.pop(self.rng.randrange(len(self.free)))
            self.gen += 1
            write_block(self.pool, b, stamp_of(self.holder, self.inc, b, self.gen))
            # Logged before the publish leaves: the checker's map of what each generation is.
            self.log.write("write", key=name, block=b, gen=self.gen, holder=self.holder, inc=self.inc)
            h = Held(b, self.gen, now + retain)
            if self.cfg.unsafe_free:
                h.early_free_at = now + self.rng.uniform(0.0, retain)
            self.held[name] = h
            entries.append((name, b, self.gen))
            new.append(name)
        return entries, new

    def _send_publish(self, entries: list[tuple[str, Any, int]], new: list[str], retain: float) -> None:
        seq = self.hot.next_publish_seq(self.node_id)  # fixed now: a fence covers it wherever it is
        reg = self.hot.registration(self.node_id)
        epoch = reg.epoch if reg is not None else None
        t = Timed()
        try:
            try:
                n_ok = self.hot.publish(self.node_id, [(self.key(k), self.blocks_of(b)) for k, b, _ in entries],
                                        retention_s=retain, seq=seq, epoch=epoch)
            except PublishFenced:
                with self.lock:  # a free fenced it: send again what is still held, as it is held
                    entries = [(k, b, g) for k, b, g in entries if k in self.held and self._entry(k) == b]
                if not entries:
                    return
                n_ok = self.hot.publish(self.node_id, [(self.key(k), self.blocks_of(b)) for k, b, _ in entries],
                                        retention_s=retain, seq=self.hot.next_publish_seq(self.node_id),
                                        epoch=epoch)
            self.log.write("publish", entries=entries, retention=retain, ok=True, accepted=n_ok, **t.fields())
        except MasterUnavailable as exc:  # may have been applied: keep held, the reaper decides
            self.log.write("publish", entries=entries, retention=retain, ok=False, err=repr(exc)[:200], **t.fields())
        except MasterError as exc:
            # Refused, but a re-registration may re-publish these held keys meanwhile: never free
            # them directly; the fenced unpublish decides (due at once).
            self.log.write("publish", entries=entries, retention=retain, ok=False, refused=True,
                           err=repr(exc)[:200], **t.fields())
            with self.lock:
                for k in new:
                    if k in self.held:
                        self.held[k].retain_until = 0.0

    def move(self) -> None:
        """Move one held key from a device block to a copy in a host block (see the module docstring)."""
        if self.superseded or not self.MOVES:
            return
        now = time.monotonic()
        with self.lock:
            movable = [k for k, h in self.held.items() if h.block < self.cfg.blocks
                       and not h.retention_end and not h.spare and h.retain_until - now > 0.5]
            if not movable or not self.host_free:
                return
            k = self.rng.choice(movable)
            h = self.held[k]
            old_block, old_gen = h.block, h.gen
            new_block = self.host_free.pop(self.rng.randrange(len(self.host_free)))
            self.gen += 1
            new_gen = self.gen
            write_block(self.pool, new_block, stamp_of(self.holder, self.inc, new_block, new_gen))
            self.log.write("write", key=k, block=new_block, gen=new_gen, holder=self.holder, inc=self.inc)
            h.spare.append(new_block)  # held until the master's answer says which block it serves
            retain = h.retain_until - now
        reg = self.hot.registration(self.node_id)
        epoch = reg.epoch if reg is not None else None
        t = Timed()
        outcome, err = "failed", None
        with self.pub_lock:
            try:
                self.hot.fence(self.node_id, epoch=epoch)
                accepted = self.hot.publish(self.node_id, [(self.key(k), [new_block])], retention_s=retain,
                                            seq=self.hot.next_publish_seq(self.node_id), epoch=epoch)
                # Answered with nothing accepted: a reader's lock pins the old location.
                outcome = "moved" if accepted else "pinned"
            except MasterUnavailable as exc:
                outcome, err = "unknown", repr(exc)[:200]  # may have been applied: both blocks stay held
            except MasterError as exc:
                outcome, err = "failed", repr(exc)[:200]  # answered with an error: nothing applied
        self.log.write("move", key=k, node=self.node_id, old=[old_block, old_gen], new=[new_block, new_gen],
                       outcome=outcome, err=err, **t.fields())
        with self.lock:
            h2 = self.held.get(k)
            if h2 is not h:  # released meanwhile (superseded): its blocks, spare included, went back
                return
            if outcome == "unknown":
                return
            h.spare.remove(new_block)
            if outcome == "moved" or self.cfg.unsafe_move:
                h.block, h.gen = new_block, new_gen
                self._free_block(old_block)
                self.log.write("free", entries=[(k, old_block, old_gen)], why="moved")
                reuse = self._reuse_locked(old_block, outcome) if self.cfg.reuse_at_once else None
            else:
                self._free_block(new_block)
                return
        if reuse is not None:
            entry, retain = reuse
            self._send_publish([entry], [entry[0]], retain)

    def _reuse_locked(self, b: int, outcome: str) -> tuple[tuple[str, int, int], float] | None:
        """``reuse_at_once``: block ``b``, just freed by a move, written for a key not held and held
        (the caller publishes it), as the next publish would sooner or later. Logged with the
        move's outcome: a reuse after a "pinned" one is the broken holder's."""
        names = [key_name(p, c) for p in range(self.cfg.prompts) for c in range(self.cfg.chunks)]
        names = [n for n in names if n not in self.held]
        if not names or b not in self.free:
            return None
        self.free.remove(b)
        name = self.rng.choice(names)
        self.gen += 1
        write_block(self.pool, b, stamp_of(self.holder, self.inc, b, self.gen))
        self.log.write("write", key=name, block=b, gen=self.gen, holder=self.holder, inc=self.inc, reuse=outcome)
        now, retain = time.monotonic(), self.rng.uniform(*self.cfg.retention_s)
        h = self.held[name] = Held(b, self.gen, now + retain)
        if self.cfg.unsafe_free:
            h.early_free_at = now + self.rng.uniform(0.0, retain)
        return (name, b, self.gen), retain

    def republish(self) -> None:
        """After re-registration (session thread): held keys with the retention they have left."""
        with self.pub_lock:
            self._republish()

    def _republish(self) -> None:
        now = time.monotonic()
        groups: dict[int, list[tuple[str, int, int]]] = {}
        with self.lock:
            for k, h in self.held.items():
                left = int(h.retain_until - now)
                if not h.retention_end and left >= self.cfg.master_timeout_s + 1:
                    groups.setdefault(left, []).append((k, self._entry(k), h.gen))
        for left, entries in sorted(groups.items()):
            t = Timed()
            try:
                n = self.bg.publish(self.node_id, [(self.key(k), self.blocks_of(b)) for k, b, _ in entries],
                                   retention_s=float(left))
                self.log.write("republish", entries=entries, ok=True, accepted=n, **t.fields())
            except MasterError as exc:
                self.log.write("republish", entries=entries, ok=False, err=repr(exc)[:200], **t.fields())
                return

    def reap(self, drain_all: bool = False) -> None:
        now = time.monotonic()
        with self.lock:
            if self.cfg.unsafe_free and not drain_all:
                early = [k for k, h in self.held.items() if h.early_free_at and h.early_free_at <= now]
                if early:  # the deliberate bug: reuse without asking the master
                    self._release_locked(early, "unsafe_early_free")
            due = [k for k, h in self.held.items() if drain_all or h.retain_until <= now]
            if not due and self.rng.random() < 0.05 and self.held:  # pressure reclaim of an old key
                due = [next(iter(self.held))]
        if not due:
            return
        t = Timed()
        try:
            gone = self.bg.unpublish_if_unlocked(self.node_id, [self.key(k) for k in due],
                                                 fence_seq=self.bg.last_publish_seq(self.node_id))
            gone_set = set(gone)
            done = [k for k in due if self.key(k) in gone_set]
            self.log.write("unpublish", keys=due, gone=done, ok=True, **t.fields())
            self.unreachable_since = None
            self.release_keys(done, "unpublished")
            with self.lock:
                stale = [k for k in due if self.key(k) not in gone_set and k in self.held and self.held[k].retention_end
                         and now - self.held[k].retention_end > self.stale_after]
            self.release_keys(stale, "never_confirmed")
        except MasterError as exc:
            self.log.write("unpublish", keys=due, ok=False, err=repr(exc)[:200], **t.fields())
            t0 = self.unreachable_since = self.unreachable_since or now
            # The real holder's rule: after lease + the lock TTL cap without any master answer
            # (heartbeats count), it has dropped our entries and every lock it granted expired.
            t0 = max(t0, self.session.last_ok_at or 0.0)
            if now - t0 > self.cfg.lease_ttl_s + self.max_lock_ttl:
                self.release_keys(due, "master_lost")
        with self.lock:
            retry = time.monotonic() + min(1.0, self.cfg.lock_ttl_s)
            for k in due:
                h = self.held.get(k)
                if h is not None and h.retain_until <= now:
                    h.retention_end = h.retention_end or now
                    h.retain_until = retry

    def release_keys(self, keys: list[str], why: str) -> None:
        with self.lock:
            self._release_locked(keys, why)

    def _release_locked(self, keys: list[str], why: str) -> None:
        out = []
        for k in keys:
            if k not in self.held:
                continue
            entry = self._entry(k)
            h = self.held.pop(k)
            self._return_blocks(h)
            out.append((k, entry, h.gen))
        if out:
            self.log.write("free", entries=out, why=why)

    def census(self) -> dict[str, int]:
        with self.lock:
            return {"held_keys": len(self.held),
                    "held_blocks": len({b for k in self.held for b in self.blocks_of(self._entry(k))})}

    def _entry(self, k: str) -> Any:
        """What a held key's entries log and publish as its block(s)."""
        return self.held[k].block

    def _return_blocks(self, h: Held) -> None:
        for b in (h.block, *h.spare):
            self._free_block(b)
        h.spare.clear()

    def _free_block(self, b: int) -> None:
        (self.free if b < self.cfg.blocks else self.host_free).append(b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos-holder")
    ap.add_argument("--config", required=True)
    ap.add_argument("--holder", type=int, required=True)
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--inc", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--name", required=True, help="process name in the logs")
    args = ap.parse_args(argv)
    die_with_parent()
    with open(args.config) as f:
        cfg = ChaosConfig.from_json(f.read())
    if args.name.startswith("dup"):
        time.sleep(cfg.dup_start_delay_s)
    log = OpLog(args.log, args.name)
    fds0, threads0 = open_fds(), threading.active_count()
    if cfg.holder_is_kv(args.holder):
        from tests.chaos.kv_holder import KVHolder  # imports this module

        h: Holder = KVHolder(cfg, args.holder, args.node_id, args.inc, log, args.master)
    else:
        h = Holder(cfg, args.holder, args.node_id, args.inc, log, args.master)
    h.session.start()
    log.write("start", node=args.node_id, holder=args.holder, inc=args.inc, fds=fds0, threads=threads0,
              registered=h.session.registered)
    stopping_since: float | None = None
    drained = False
    while not ctl(cfg.workdir, "exit"):
        stopping = ctl(cfg.workdir, "stop")
        if stopping and stopping_since is None:
            stopping_since = time.monotonic()
        if not stopping and h.rng.random() < 0.5:
            h.publish()
        if not stopping and h.rng.random() < cfg.move_p:
            h.move()
        h.reap()
        if stopping and not drained and h.census()["held_keys"] == 0:
            # Nothing held and nothing new once stopped: the harness's quiet period waits for this.
            drained = True
            log.write("drained")
        time.sleep(h.rng.uniform(*cfg.op_gap_s) if not stopping else 0.05)
    census = h.census()
    h.session.stop(deregister=True)
    h.hot.close()
    h.bg.close()
    h.transport.close()
    fds1, threads1 = open_fds(), settle_threads(threads0)
    log.write("final", fds_start=fds0, fds_end=fds1, threads_start=threads0, threads_end=threads1, **census)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
