"""Eviction: keeping each tier under its watermark without losing objects that have
somewhere to go, and making room for a put at once, in the pool's order.

Tiers, fastest first: vram -> dram -> ssd. Victims come in the order of `PoolOrder`
(`poolorder.py`, the code the simulator runs too): one recency per tier over every node's
segments (the master sees the whole pool), *spare* replicas (the object keeps more copies
than its put asked for: a hot-spot duplicate on another node, or a copy in another tier,
typically on SSD: the object is *clean* here) before *last* copies, least recently used
first in each. A pass (`run`) does, per tier:

1. evict: when the used share is above the high watermark (or a put found no room:
   "pressure"), victims in that order (skipping leased, pinned, uncommitted and moving
   objects) until the share would be under the low watermark (and the put would fit).
   Last copies are victims only where a lower tier is mounted (they are demoted): with
   nowhere to go, a last copy stays until a put needs its room (`make_room`), so the pool
   keeps its whole capacity for distinct objects;
2. copy ahead: when the used share is above `copy_ahead_watermark`, the least recently
   used objects past that share get a copy in the tier below (the replica here is kept),
   so that they are clean by the time they become victims.

For each victim, its replicas in the tier:

    | victim                                 | what happens                                 |
    |----------------------------------------|----------------------------------------------|
    | duplicated here (two or more replicas) | all but its first replica here dropped       |
    | clean (a replica in another tier)      | dropped: demoted events when the same node   |
    |                                        | keeps it lower, else evicted                 |
    | a last copy, a lower tier has room     | one demoted (a move), the others dropped     |
    | a last copy, nowhere to go             | dropped: the object leaves the pool          |

A put that finds no room does not wait for a pass (`make_room`): in the allocation path it
drops spare replicas, in the pool's order, until the value fits in one segment (the put
goes there: placement follows the pool's order, not the writer's node). Last copies are
dropped for it only where no lower tier is mounted (the policy above would drop them too);
otherwise they wait for their demotion and the put goes on to its next tier (the KV pool
asks for DRAM, then SSD), or answers no_space when none has room. Protected objects are
never touched; when dropping every candidate would not make the value fit, nothing is
dropped. Hot-spot duplicates are bounded by `replica_budget` (`moves.py`).

Under `local_first` placement a put into its writer's full memory segment stays there
(`room_on_writer`): the writer's first objects in the pool's order make room, each a
spare copy giving up its range or a last copy *relocated*: moved to another segment's
free room, else to where the pool's first victim was dropped, keeping its place in the
order (the pool's first victim on the writer itself is dropped as usual). The pool holds
what the plain order would hold, and each node keeps what it wrote or read last, so the
next turn of a conversation finds its prefix on one node. A relocated object's bytes are
copied by the put's writer before it writes (`Relocation`, pool.py's `relocate`).

The Evictor takes only what it uses: the pool's state (`pool.py`: segments, objects,
order, and the edits that release replicas), the moves and the settings. The moves
themselves (copies between tiers and nodes, confirmed by the data plane) are `moves.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mooncake.store.metadata.objects import (
    COMPLETE,
    TIERS,
    Instruction,
    ObjectRecord,
    Relocation,
    Replica,
    Segment,
    Tier,
)

if TYPE_CHECKING:
    from mooncake.store.metadata.moves import Mover
    from mooncake.store.metadata.pool import Pool
    from mooncake.store.metadata.settings import MetadataConfig

# tier -> where its victims may move (copies ahead too), first choice first
BELOW: dict[Tier, tuple[Tier, ...]] = {"vram": ("dram", "ssd"), "dram": ("ssd",), "ssd": ()}


def _aligned(r: Replica) -> int:
    return r.segment.allocator.aligned(r.size)


def is_clean(obj: ObjectRecord, tier: Tier) -> bool:
    """Whether `obj` has a committed replica outside `tier` (so its replicas in `tier` may go
    without losing it)."""
    return any(r.tier != tier and r.state == COMPLETE for r in obj.replicas)


def going(obj: ObjectRecord, tier: Tier, is_spare: bool) -> list[Replica]:
    """The replicas of `obj` in `tier` that eviction takes: a spare object's duplicates
    there (all but the first), or all of them."""
    here = [r for r in obj.replicas if r.tier == tier and r.state == COMPLETE]
    return here[1:] if is_spare and len(here) > 1 else here


class Evictor:
    """Eviction passes, copies ahead, and room made for puts."""

    def __init__(self, pool: Pool, mover: Mover, config: MetadataConfig):
        self.pool = pool
        self.space = pool.space
        self.objects = pool.objects  # key -> record
        self.order = pool.order
        self.mover = mover
        self.config = config
        self.pressure: dict[Tier, int] = {}  # tier -> largest size a put found no room for

    def has_below(self, tier: Tier) -> bool:
        """Whether a tier below `tier` is mounted (its victims can move down)."""
        return any(self.space.tier_segments[t] for t in BELOW[tier])

    def is_room_coming(self, tier: Tier, now: float) -> bool:
        """Whether room in `tier` is on its way: demotions in flight, ranges freed when
        readers' leases end, or a victim the next pass can move down; changes nothing."""
        if self.mover.pending_release(tier) or any(
            r.segment.tier == tier for _, r in self.space.deferred
        ):
            return True
        return self.has_below(tier) and self._first_victim(tier, now, spare_only=False) is not None

    def note_pressure(self, tier: Tier, size: int) -> None:
        """A put of `size` bytes found no room in `tier`: the next pass makes some."""
        self.pressure[tier] = max(self.pressure.get(tier, 0), size)

    # -- passes --------------------------------------------------------------------------

    def run(self, now: float) -> int:
        """One pass over every tier (evict, then copy ahead); returns the number of victim
        objects."""
        self.space.release_due(now)  # ranges whose readers' leases ended
        victims = 0
        for tier in TIERS:
            chosen = self._choose(tier, now)
            for obj, is_spare in chosen:
                self._evict(obj, tier, is_spare, now)
            victims += len(chosen)
            self._copy_ahead(tier, now)
        return victims

    def _choose(self, tier: Tier, now: float) -> list[tuple[ObjectRecord, bool]]:
        """The victims of `tier` with whether each is spare, in the pool's order."""
        space, cfg = self.space, self.config
        need = self.pressure.pop(tier, 0)
        usable = space.tier_usable[tier]
        used = space.tier_used[tier] - self.mover.pending_release(tier)
        over = used > cfg.high_watermark * usable
        target = cfg.low_watermark * usable if over else used
        segs = space.tier_segments[tier]
        met = not need or any(s.allocator.can_fit(need) for s in segs)
        if not usable or (not over and met):
            return []
        freed_in: dict[Segment, list[int]] = {}  # segment -> offsets the victims free
        freed, chosen, spare = 0, [], self.order.spare[tier]
        at_mark = 0 if used <= target else None  # victims the watermark alone needs
        # NOTE: last copies with nowhere to go stay until a put needs their room
        for key in self.order.victims(tier, spare_only=not self.has_below(tier)):
            obj = self.objects[key]
            if obj.is_protected(now):
                continue
            is_spare = key in spare
            chosen.append((obj, is_spare))
            for r in going(obj, tier, is_spare):
                freed += _aligned(r)
                alloc = r.segment.allocator
                offsets = freed_in.setdefault(r.segment, [])
                offsets.append(r.offset)
                met = met or alloc.largest_free_after(offsets) >= alloc.aligned(need)
            if at_mark is None and used - freed <= target:
                at_mark = len(chosen)
            if met and at_mark is not None:
                break
        if not met:  # NOTE: no eviction makes room for the put: evict for the watermark only
            return chosen[:at_mark] if at_mark is not None else chosen
        return chosen

    def _evict(self, obj: ObjectRecord, tier: Tier, is_spare: bool, now: float) -> None:
        here = going(obj, tier, is_spare)
        kept = None
        if not is_spare and BELOW[tier]:
            kept = self.mover.start(obj, here, "demote", BELOW[tier], "", now)
        self._drop(obj, [r for r in here if r is not kept], now)

    def _drop(self, obj: ObjectRecord, replicas: Iterable[Replica], now: float) -> None:
        """Drop `replicas` of an unprotected `obj` (and `obj` when none is left). A replica
        whose node keeps the object in a lower tier counts as demoted, others as evicted."""
        pool = self.pool
        for r in replicas:
            desc = r.desc()
            pool.detach(obj, r, now, emit="evicted")
            rank = TIERS.index(r.tier)
            left = [TIERS.index(o.tier) for o in obj.complete() if o.node_id == r.node_id]
            if left and min(left) > rank:
                pool.counters.demotions += 1
            else:
                pool.counters.evictions += 1
            pool.instruct(r.node_id, Instruction(kind="evict", key=obj.key, src=desc))
        if not obj.replicas:
            pool.drop(obj, now, emit=None)

    def _copy_ahead(self, tier: Tier, now: float) -> None:
        """Copy the least recently used objects past `copy_ahead_watermark` of `tier` to
        the tier below, keeping them here; stops at the first that finds no room there."""
        space = self.space
        below = BELOW[tier]
        if not self.has_below(tier):
            return
        usable = space.tier_usable[tier]
        excess = (
            space.tier_used[tier]
            - self.mover.pending_release(tier)
            - self.config.copy_ahead_watermark * usable
        )
        covered = 0  # bytes of the LRU end that are clean or on their way
        for key in self.order.order[tier]:
            if covered >= excess:
                return
            obj = self.objects[key]
            here = [r for r in obj.replicas if r.tier == tier]
            moving = self.mover.moves[obj.move_id].kind if obj.move_id else ""
            if moving == "demote":  # NOTE: already out of `excess` (pending release)
                continue
            if obj.is_protected(now) and not moving:
                continue  # not a victim soon: the copies must cover others
            covered += sum(_aligned(r) for r in here)
            if moving or is_clean(obj, tier):
                continue
            if self.mover.start(obj, here, "copy", below, "", now) is None:
                return  # NOTE: no room below; that tier's own pass evicts, the next retries

    # -- room for a put ------------------------------------------------------------------

    def make_room(self, tier: Tier, size: int, now: float) -> bool:
        """Drop replicas in one segment of `tier` (usable now) until it can take `size`
        bytes: spare replicas (duplicates, clean copies) in the pool's order; where no
        lower tier is mounted (victims have nowhere to go), then also objects' last
        replicas. Never a protected object's. False, dropping nothing, if that does not
        make room."""
        space = self.space
        segs = {s for s in space.tier_segments[tier] if s.usable_from <= now}
        if space.release_due(now) and any(s.allocator.can_fit(size) for s in segs):
            return True  # ranges whose readers' leases ended were enough
        victims = self._victims_for(tier, size, segs, now, spare_only=self.has_below(tier))
        if victims is None:
            return False
        for obj, r in victims:
            self._drop(obj, [r], now)
        return True

    def room_on_writer(
        self, seg: Segment, size: int, put_key: str, now: float
    ) -> list[tuple[ObjectRecord, Replica, Relocation]]:
        """Make the writer's full segment `seg` fit `size` bytes for the put of `put_key`
        (module docstring); returns the objects relocated (with their new replica and what
        the writer copies). When a last copy finds no room elsewhere, nothing on `seg`
        moves (spare copies there and victims dropped elsewhere cost nothing: the pool's
        order would drop them next)."""
        tier, space = seg.tier, self.space
        spare_only = self.has_below(tier)  # NOTE: last copies wait for their demotion
        others = {
            s
            for s in space.tier_segments[tier]
            if s.usable_from <= now and s.node_id != seg.node_id
        }
        mine = self._victims_for(tier, size, {seg}, now, spare_only=False)
        if mine is None:
            return []
        going: list[tuple[ObjectRecord, Replica]] = []  # the pool's first victim, as usual
        moving: list[tuple[ObjectRecord, Replica, Replica]] = []  # (object, from, to)
        for obj, r in mine:
            if obj.key in self.order.spare[tier] or len(obj.replicas) != 1:
                self._drop(obj, [r], now)  # a spare copy gives up its range (first: its
                continue  # other copies are last ones now, never victims for the room below)
            dst = self._allocate_in(obj, self._free_room(obj, others))
            if dst is None and not moving and self._first_victim(tier, now, spare_only) is obj:
                going.append((obj, r))
                continue
            if dst is None:
                room = self._victims_for(tier, obj.size, others, now, spare_only)
                if room is not None:
                    for victim, vr in room:
                        self._drop(victim, [vr], now)
                    dst = self._allocate_in(obj, room[0][1].segment)
            if dst is None:
                for o, _, d in moving:  # NOTE: allocated only: freed as if never taken
                    space.free(o.key, d)
                return []
            moving.append((obj, r, dst))
        for obj, r in going:
            self._drop(obj, [r], now)
        pool = self.pool
        return [(obj, dst, pool.relocate(obj, r, dst, put_key)) for obj, r, dst in moving]

    def _allocate_in(self, obj: ObjectRecord, seg: Segment | None) -> Replica | None:
        return self.space.allocate(seg, obj.key, obj.size) if seg is not None else None

    def _free_room(self, obj: ObjectRecord, segs: set[Segment]) -> Segment | None:
        """The emptiest of `segs` with room for `obj` now, on a node not holding it."""
        holders = {r.node_id for r in obj.replicas}
        fits = [s for s in segs if s.node_id not in holders and s.allocator.can_fit(obj.size)]
        return min(fits, key=lambda s: (-s.free_ratio, s.name), default=None)

    def _first_victim(self, tier: Tier, now: float, spare_only: bool) -> ObjectRecord | None:
        """The pool's first unprotected victim in `tier`."""
        for key in self.order.victims(tier, spare_only):
            obj = self.objects[key]
            if not obj.is_protected(now):
                return obj
        return None

    def _victims_for(
        self, tier: Tier, size: int, segs: set[Segment], now: float, spare_only: bool
    ) -> list[tuple[ObjectRecord, Replica]] | None:
        """The fewest replicas of one of `segs` whose release leaves a free block of `size`
        there, in the pool's order (spare ones, then, unless `spare_only`, last copies);
        None if releasing all of them would not."""
        chosen: dict[Segment, list[tuple[ObjectRecord, Replica]]] = {}
        offsets: dict[Segment, list[int]] = {}  # segment -> offsets the victims free
        for key in self.order.victims(tier, spare_only):
            obj = self.objects[key]
            if obj.is_protected(now):
                continue
            # NOTE: one segment's victims are taken, so a duplicated object keeps a replica
            for r in obj.replicas:
                if r.tier != tier or r.state != COMPLETE or r.segment not in segs:
                    continue
                chosen.setdefault(r.segment, []).append((obj, r))
                freed = offsets.setdefault(r.segment, [])
                freed.append(r.offset)
                alloc = r.segment.allocator
                if alloc.largest_free_after(freed) >= alloc.aligned(size):
                    return chosen[r.segment]
        return None

    # -- moves (moves.py) ----------------------------------------------------------------

    def promote(self, obj: ObjectRecord, reader: str, now: float) -> bool:
        """Start copying an SSD-only object up to DRAM, keeping the SSD copy (so it stays
        clean); False if DRAM has no room under its high watermark."""
        sources = sorted(obj.complete(), key=lambda r: r.node_id != reader)
        return self.mover.start(obj, sources, "promote", ("dram",), reader, now) is not None
