"""Eviction: keeping each tier under its watermark without losing objects that have
somewhere to go, and making room for a put at once.

Tiers, fastest first: vram -> dram -> ssd. An object is *clean* in a tier when it also has
a committed replica in another tier (typically a copy on SSD of the same node): dropping
its replica here loses nothing and frees the memory at once. A pass (`run`) does, per tier:

1. evict: when the used share is above the high watermark (or a put found no room:
   "pressure"), victims in LRU order (skipping leased, pinned, uncommitted and moving
   objects) until the share would be under the low watermark (and the put would fit);
2. copy ahead: when the used share is above `copy_ahead_watermark`, the least recently
   used objects past that share get a copy in the tier below (the replica here is kept),
   so that they are clean by the time they become victims.

For each victim, its replicas in the tier:

    | victim                                 | what happens                                 |
    |----------------------------------------|----------------------------------------------|
    | clean (a replica in another tier)      | dropped: demoted events when the same node   |
    |                                        | keeps it lower, else evicted                 |
    | not clean, a lower tier has room       | one demoted (a move), the others dropped     |
    | not clean, nowhere to go               | dropped: the object leaves the pool          |

A put that finds no room does not wait for a pass (`make_room`): in the allocation path it
drops replicas of objects that keep another (clean ones), least recently used first, until
the value fits. Objects without another replica are dropped for it only where no lower
tier is mounted (the policy above would drop them too); otherwise they wait for their
demotion and the put goes on to its next tier (the KV pool asks for DRAM, then SSD), or
answers no_space when none has room. Protected objects are never touched; when dropping
every candidate would not make the value fit, nothing is dropped.

The moves themselves (copies between tiers and nodes, confirmed by the data plane) are
`moves.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mooncake.store.objects import (
    COMPLETE,
    TIERS,
    Instruction,
    ObjectRecord,
    Replica,
    Segment,
    Tier,
)

if TYPE_CHECKING:
    from mooncake.store.metadata import MetadataService
    from mooncake.store.moves import Mover

# tier -> where its victims may move (copies ahead too), first choice first
BELOW: dict[Tier, tuple[Tier, ...]] = {"vram": ("dram", "ssd"), "dram": ("ssd",), "ssd": ()}


def _aligned(r: Replica) -> int:
    return r.segment.allocator.aligned(r.size)


def is_clean(obj: ObjectRecord, tier: Tier) -> bool:
    """Whether `obj` has a committed replica outside `tier` (so its replicas in `tier` may go
    without losing it)."""
    return any(r.tier != tier and r.state == COMPLETE for r in obj.replicas)


class Evictor:
    """Eviction passes, copies ahead, and room made for puts."""

    def __init__(self, svc: MetadataService):
        self.svc = svc
        self.mover: Mover = svc.mover
        self.pressure: dict[Tier, int] = {}  # tier -> largest size a put found no room for

    def note_pressure(self, tier: Tier, size: int) -> None:
        """A put of `size` bytes found no room in `tier`: the next pass makes some."""
        self.pressure[tier] = max(self.pressure.get(tier, 0), size)

    # -- passes --------------------------------------------------------------------------

    def run(self, now: float) -> int:
        """One pass over every tier (evict, then copy ahead); returns the number of victim
        objects."""
        self.svc.space.release_due(now)  # ranges whose readers' leases ended
        victims = 0
        for tier in TIERS:
            chosen = self._choose(tier, now)
            for obj in chosen:
                self._evict(obj, tier, now)
            victims += len(chosen)
            self._copy_ahead(tier, now)
        return victims

    def _choose(self, tier: Tier, now: float) -> list[ObjectRecord]:
        space, cfg = self.svc.space, self.svc.config
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
        freed, chosen, objects = 0, [], self.svc.objects
        at_mark = 0 if used <= target else None  # victims the watermark alone needs
        for key in self.svc.lru[tier]:
            obj = objects[key]
            if obj.is_protected(now):
                continue
            chosen.append(obj)
            for r in obj.replicas:
                if r.tier == tier:
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

    def _evict(self, obj: ObjectRecord, tier: Tier, now: float) -> None:
        here = [r for r in obj.replicas if r.tier == tier]
        kept = None
        if BELOW[tier] and not is_clean(obj, tier):
            kept = self.mover.start(obj, here, "demote", BELOW[tier], "", now)
        self._drop(obj, [r for r in here if r is not kept], now)

    def _drop(self, obj: ObjectRecord, replicas: Iterable[Replica], now: float) -> None:
        """Drop `replicas` of an unprotected `obj` (and `obj` when none is left). A replica
        whose node keeps the object in a lower tier counts as demoted, others as evicted."""
        svc = self.svc
        for r in replicas:
            desc = r.desc()
            svc.detach(obj, r, now, emit="evicted")
            rank = TIERS.index(r.tier)
            left = [TIERS.index(o.tier) for o in obj.complete() if o.node_id == r.node_id]
            if left and min(left) > rank:
                svc.counters.demotions += 1
            else:
                svc.counters.evictions += 1
            svc.instruct(r.node_id, Instruction(kind="evict", key=obj.key, src=desc))
        if not obj.replicas:
            svc.drop(obj, now, emit=None)

    def _copy_ahead(self, tier: Tier, now: float) -> None:
        """Copy the least recently used objects past `copy_ahead_watermark` of `tier` to
        the tier below, keeping them here; stops at the first that finds no room there."""
        svc, space = self.svc, self.svc.space
        below = BELOW[tier]
        if not below or not any(space.tier_segments[t] for t in below):
            return
        usable = space.tier_usable[tier]
        excess = (
            space.tier_used[tier]
            - self.mover.pending_release(tier)
            - svc.config.copy_ahead_watermark * usable
        )
        covered = 0  # bytes of the LRU end that are clean or on their way
        for key in svc.lru[tier]:
            if covered >= excess:
                return
            obj = svc.objects[key]
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
        bytes: replicas whose object keeps another one (a copy), least recently used first;
        where no lower tier is mounted (victims have nowhere to go), then also objects'
        last replicas. Never a protected object's. False, dropping nothing, if that does
        not make room."""
        space = self.svc.space
        segs = {s for s in space.tier_segments[tier] if s.usable_from <= now}
        if space.release_due(now) and any(s.allocator.can_fit(size) for s in segs):
            return True  # ranges whose readers' leases ended were enough
        below = any(space.tier_segments[t] for t in BELOW[tier])
        victims = self._victims_for(tier, size, segs, now, (True,) if below else (True, False))
        if victims is None:
            return False
        for obj, r in victims:
            self._drop(obj, [r], now)
        return True

    def _victims_for(
        self, tier: Tier, size: int, segs: set[Segment], now: float, spare: tuple[bool, ...]
    ) -> list[tuple[ObjectRecord, Replica]] | None:
        """The fewest replicas of one of `segs` whose release leaves a free block of `size`
        there, taken in LRU order: those whose object keeps another replica, then (if
        `spare` has False) the others; None if releasing all of them would not."""
        svc = self.svc
        chosen: dict[Segment, list[tuple[ObjectRecord, Replica]]] = {}
        offsets: dict[Segment, list[int]] = {}  # segment -> offsets the victims free
        for is_spare in spare:
            for key in svc.lru[tier]:
                obj = svc.objects[key]
                if obj.is_protected(now) or (len(obj.replicas) > 1) != is_spare:
                    continue
                for r in obj.replicas:
                    if r.tier != tier or r.segment not in segs:
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
