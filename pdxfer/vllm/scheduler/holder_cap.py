"""The holder's cap on held blocks: publish only the prefix of a request that fits under
``max_held_fraction`` of vLLM's block pool, and reclaim the oldest held chunks early enough that
the next request fits whole.

Room comes only from the master's compare-and-unpublish (a chunk a reader locked stays), asked on
the publisher thread so the step never waits and no unpublish overtakes a queued publish of the
same key; chunks with a complete host copy move to the host tier instead. The blocks return to
vLLM at the scheduler's next hook (``HolderPath.drain_frees``).

With a host tier, a computed chunk is never dropped for the cap while the tier has room for it:
the finished request's blocks are held (over the cap) until their host copies complete, a step or
two later, and then move to the host tier, oldest first, until the held blocks are under the cap
again. A chunk whose copy is still being made is never unpublished by a reclaim: it moves once
copied. Only a chunk with no room on the device nor in the host tier is left unpublished
(``chunks_over_cap``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdxfer.kv.groups import held_blocks
from pdxfer.master import MasterError

if TYPE_CHECKING:
    from pdxfer.vllm.scheduler.holder import HolderPath

log = logging.getLogger("pdxfer.vllm.scheduler")

# How fast the room kept for the largest recent request shrinks (per request) when requests get
# smaller: a burst of long prompts is remembered for a few dozen requests.
_ROOM_DECAY = 0.95


class HeldCap:
    """The cap of one ``HolderPath``; works on its held chunks under its ``_lock``."""

    def __init__(self, holder: HolderPath) -> None:
        self._h = holder
        self.reclaiming = False  # guarded by the holder's _lock: one reclaim at a time
        self._room_wanted = 0  # blocks the largest recent request took (decaying): kept free

    def fit(self, new: list[tuple[bytes, tuple[int, ...]]]) -> list[tuple[bytes, tuple[int, ...]]]:
        """Keep held blocks under ``max_held_fraction`` of the pool: publish only the leading
        chunks that fit (a prefix is what readers use; with a host tier, also those beyond the
        cap its free slots can take, held until copied), and reclaim the oldest unlocked chunks in
        the background early enough that the next request fits whole (a P/D decode wants the
        whole prompt its prefill just computed): room for the largest recent request is kept."""
        hp = self._h
        assert hp._pool is not None
        cap = hp.held_blocks_cap
        host_ok = hp.host_tier.usable()
        with hp._lock:  # the reaper thread mutates the held set: work on a snapshot
            held_now = set(hp._held_block_refs)
            host_room = hp.host_tier.slots.free_count if host_ok else 0
        want = {x for _, b in new for x in held_blocks(b)} - held_now
        self._room_wanted = max(len(want), int(self._room_wanted * _ROOM_DECAY))
        out: list[tuple[bytes, tuple[int, ...]]] = []
        seen: set[int] = set()
        for i, (k, b) in enumerate(new):
            add = {x for x in held_blocks(b) if x not in held_now and x not in seen}
            copies = len(held_blocks(b))  # with a host tier every new chunk gets a host copy
            if len(held_now) + len(seen) + len(add) > cap and (not host_ok or copies > host_room):
                # Over the cap, and no host slot to copy it to: the only chunks ever dropped.
                # (Under the cap with the host tier full, the host LRU makes room: as before.)
                hp.stats.chunks_over_cap += len(new) - i
                break
            # Over the cap with room in the host tier: held only while its copy is made, then
            # it moves there (offload_output reclaims what is over the cap).
            host_room -= min(copies, host_room) if host_ok else 0
            seen |= add
            out.append((k, b))
        # Room comes from the master's compare-and-unpublish: ask in the background (never block
        # the step); the blocks return at a later scheduler hook, before the next request.
        over = len(held_now) + len(want) - (cap - min(self._room_wanted, cap))
        if over > 0:
            self.reclaim_async(over, keep={k for k, _ in out})
        return out

    def over_cap(self) -> int:
        """Held blocks above the cap (under _lock): what a reclaim should free now."""
        return len(self._h._held_block_refs) - self._h.held_blocks_cap

    def reclaim_async(self, want_blocks: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Unpublish the oldest held chunks in the background until about ``want_blocks`` blocks
        free (never those in ``keep``: being published now); their blocks return to vLLM at the
        scheduler's next hook (one reclaim at a time)."""
        hp = self._h
        assert hp._pool is not None and hp.node_id is not None
        with hp._lock:
            if self.reclaiming:
                return
            candidates: list[bytes] = []
            freed: set[int] = set()
            copying = hp.host_tier.usable()
            for k, h in hp._held.items():  # oldest first
                if len(freed) >= want_blocks:
                    break
                if k in keep or h.moving or h.leaving:
                    continue
                if copying and h.job_id:  # its host copy is on its way: it moves once made
                    continue
                candidates.append(k)
                freed.update(x for x in held_blocks(h.blocks) if hp._held_block_refs.get(x, 0) <= 1)
            if not candidates:
                return
            self.reclaiming = True
            moves = hp.host_tier.mark_moving(candidates)
            candidates = [k for k in candidates if k not in moves]
            hp._mark_leaving(candidates)

        def run() -> None:
            moved: list[bytes] = []
            done: list[bytes] = []
            try:
                moved = hp.host_tier.move(moves) if moves else []
                done = hp._unpublish(hp._hot, candidates) if candidates else []
            except MasterError as exc:
                log.debug("pdxfer: pressure unpublish failed: %s", exc)
            finally:
                hp._forget(done)  # before the marks go, so the reaper never picks what this frees
                with hp._lock:
                    self.reclaiming = False
                    hp._mark_leaving(candidates, False)
                    hp._wake.notify()  # the reaper skipped them meanwhile: those still held may be due
            hp.stats.pressure_reclaims += len(done) + len(moved)

        # On the publisher thread: an unpublish must not overtake a queued publish of the same key.
        try:
            hp._publisher.submit(run)
        except RuntimeError:  # closing
            with hp._lock:
                self.reclaiming = False
                hp._mark_leaving(candidates, False)
                for k in moves:
                    h = hp._held.get(k)
                    if h is not None:
                        h.moving = False
