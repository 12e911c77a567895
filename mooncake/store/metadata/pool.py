"""The pool's state as one structure, and the edits every protocol makes to it.

`Pool` holds what the metadata service knows of the pool: the segments and their space
(`SegmentManager`), the objects with their replicas, the puts in flight, the eviction
order (`poolorder.py`), the counters, and what changed since it was last asked: events for
the Conductor's index, instructions for the data plane, keys and segments for the journal
(`poolstate.py`, whose entries are this state's committed part; `snapshot` and `restore`
are here, so poolstate.py knows nothing of `Pool`). The protocols (writes, slots,
eviction, moves, membership) each take the pool and the few other collaborators they use,
never the service: they change the pool only through its fields and these edits.

Pure logic: no I/O, no threads, no clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mooncake.store.metadata.objects import (
    COMPLETE,
    TIERS,
    Counters,
    EventKind,
    Instruction,
    ObjectRecord,
    Relocation,
    Replica,
    StoreEvent,
)
from mooncake.store.metadata.poolorder import PoolOrder
from mooncake.store.metadata.poolstate import PoolChanges, PoolState, object_entry, segment_entry
from mooncake.store.metadata.segments import SegmentManager

log = logging.getLogger(__name__)


def _nothing(_obj: ObjectRecord) -> None:
    return None


class Pool:
    """Segments, objects, puts in flight, eviction order, counters and pending changes."""

    def __init__(self, space: SegmentManager):
        self.space = space
        self.objects: dict[str, ObjectRecord] = {}
        self.writing: dict[str, None] = {}  # keys in PROCESSING, oldest put first
        # NOTE: True while `writing` is in started_at order too (a caller's clock never went
        # back), which lets expiry stop at the first put not yet timed out
        self.is_writing_in_order = True
        self._last_started_at = 0.0  # s: started_at of the newest put in `writing`
        # per tier: keys with a COMPLETE replica there, pool-wide, in eviction order
        self.order: PoolOrder[str] = PoolOrder(TIERS)
        self.counters = Counters()
        self.events: list[StoreEvent] = []
        self.instructions: dict[str, list[Instruction]] = {}  # node id -> its instructions
        # NOTE: what changed in the committed state since the last drain_changes (poolstate.py)
        self.changed_keys: dict[str, None] = {}
        self.changed_segments: dict[str, None] = {}
        # what else holds a dropped object (its tier move, its write slot): set by the owner
        self.on_drop: Callable[[ObjectRecord], None] = _nothing

    # -- edits ---------------------------------------------------------------------------

    def start_writing(self, obj: ObjectRecord) -> None:
        """Add a put (or a write slot) just started to `objects` and `writing`."""
        if not self.writing:
            self.is_writing_in_order = True
        elif obj.started_at < self._last_started_at:
            self.is_writing_in_order = False
        self._last_started_at = obj.started_at
        self.objects[obj.key] = obj
        self.writing[obj.key] = None

    def emit(self, kind: EventKind, key: str, node_id: str, tier: str = "") -> None:
        self.events.append(StoreEvent(kind=kind, key=key, node_id=node_id, tier=tier))

    def instruct(self, node_id: str, instruction: Instruction) -> None:
        self.instructions.setdefault(node_id, []).append(instruction)

    def forget_instructions(self, node_id: str) -> None:
        self.instructions.pop(node_id, None)

    def commit(self, obj: ObjectRecord, r: Replica) -> None:
        """Replica `r` of `obj` becomes readable: in the order, and announced (`emit_gain`)."""
        r.state = COMPLETE
        self.order.add(obj.key, r.tier, obj.size, obj.wanted)
        self.emit_gain(obj, r)

    def emit_gain(self, obj: ObjectRecord, r: Replica) -> None:
        """Replica `r` was just committed: an added event if its node held no other, a
        promoted one if the others there are in slower tiers, else none."""
        node = r.node_id
        self.changed_keys[obj.key] = None
        here = [TIERS.index(o.tier) for o in obj.complete() if o.node_id == node and o is not r]
        if not here:
            self.emit("added", obj.key, r.node_id, r.tier)
        elif TIERS.index(r.tier) < min(here):
            self.emit("promoted", obj.key, r.node_id, r.tier)

    def detach(
        self, obj: ObjectRecord, r: Replica, now: float, emit: EventKind | None, free: bool = True
    ) -> None:
        """Take replica `r` off `obj` (and out of the order); free its range (after the
        lease if readers may hold it) unless `free` is False. `emit` is the event if its
        node keeps no other replica; one kept in a slower tier makes it a demoted event,
        one in a faster tier no event."""
        obj.replicas.remove(r)
        if r.state == COMPLETE:
            self.changed_keys[obj.key] = None
            self.order.remove(obj.key, r.tier)
            here = [TIERS.index(o.tier) for o in obj.complete() if o.node_id == r.node_id]
            if emit and not here:
                self.emit(emit, obj.key, r.node_id, r.tier)
            elif emit and min(here) > TIERS.index(r.tier):
                self.emit("demoted", obj.key, r.node_id, TIERS[min(here)])
        if free:
            until = obj.lease_until if r.state == COMPLETE else 0.0
            self.space.free(obj.key, r, until, now)
        else:
            r.segment.keys.discard(obj.key)

    def relocate(self, obj: ObjectRecord, r: Replica, dst: Replica, put_key: str) -> Relocation:
        """Move unprotected `obj`'s only replica `r` to `dst` (allocated for it, PROCESSING)
        for the put of `put_key` to copy (eviction.py, `room_on_writer`): `r`'s range is
        freed at once, `obj` keeps its place in the order and reads as a miss until that
        put ends (`settle_relocations`)."""
        assert obj.replicas == [r] and obj.is_committed and not obj.move_id, obj.key
        src = r.desc()
        obj.replicas = [dst]
        obj.relocated_by = put_key
        self.space.free(obj.key, r)
        self.changed_keys[obj.key] = None  # NOTE: out of the journal until the copy is done
        self.emit("evicted", obj.key, r.node_id, r.tier)
        return Relocation(key=obj.key, src=src, dst=dst.desc())

    def settle_relocations(self, put: ObjectRecord) -> None:
        """The put carrying them ended: the objects it relocated are readable there."""
        for moved, dst in put.relocations:
            if self.objects.get(moved.key) is moved and moved.relocated_by == put.key:
                dst.state = COMPLETE  # NOTE: already in the order: it kept its place
                moved.relocated_by = ""
                self.emit_gain(moved, dst)
        put.relocations = []

    def drop(self, obj: ObjectRecord, now: float, emit: EventKind | None) -> None:
        """Forget `obj`, freeing every replica (emitting `emit` for each committed one);
        the objects its put was relocating go too (their bytes may be overwritten)."""
        self.on_drop(obj)
        for moved, _ in obj.relocations:
            if self.objects.get(moved.key) is moved and moved.relocated_by == obj.key:
                self.drop(moved, now, emit=None)
        obj.relocations = []
        if obj.relocated_by:  # NOTE: its replica never re-entered the order: its place goes
            for tier in list(self.order.copies.get(obj.key, ())):
                self.order.remove(obj.key, tier)
            obj.relocated_by = ""
        # NOTE: slowest first, so that a node keeping it in two tiers gets one event
        for r in sorted(obj.replicas, key=lambda r: -TIERS.index(r.tier)):
            self.detach(obj, r, now, emit)
        del self.objects[obj.key]
        self.writing.pop(obj.key, None)

    # -- what changed --------------------------------------------------------------------

    def drain_events(self) -> list[StoreEvent]:
        """The events since the last drain, oldest first (for the Conductor's index)."""
        events, self.events = self.events, []
        return events

    def drain_changes(self) -> PoolChanges:
        """The segments and committed objects changed since the last drain, each with its
        entry now (None: gone), for a journal (poolstate.py)."""
        out = PoolChanges()
        for name in self.changed_segments:
            seg = self.space.segments.get(name)
            out.segments[name] = segment_entry(seg) if seg is not None else None
        for key in self.changed_keys:
            out.objects[key] = object_entry(self.objects.get(key))
        self.changed_segments, self.changed_keys = {}, {}
        return out

    def drain_instructions(self, node_id: str | None = None) -> list[Instruction]:
        """Pending instructions for `node_id` (None: for every node), oldest first."""
        if node_id is not None:
            return self.instructions.pop(node_id, [])
        out = [i for batch in self.instructions.values() for i in batch]
        self.instructions.clear()
        return out

    # -- the committed state as plain entries (poolstate.py) -----------------------------

    def snapshot(self) -> PoolState:
        """The pool's committed state, segments by name and objects by key (two pools with the
        same contents compare equal); changes nothing."""
        segs = sorted(
            (segment_entry(s) for s in self.space.segments.values()), key=lambda e: e.name
        )
        objs = [e for o in self.objects.values() if (e := object_entry(o)) is not None]
        objs.sort(key=lambda e: e.key)
        return PoolState(segments=tuple(segs), objects=tuple(objs))

    def restore(self, state: PoolState, now: float, lease_ttl_s: float, wanted: int = 1) -> int:
        """Rebuild this pool (which must be empty) from `state`; returns the objects restored.
        Restored objects are leased for `lease_ttl_s`, and count `wanted` copies as asked for.
        Every restored replica is announced (added events: the Conductor's prefix index).
        A replica whose range is not free (a journal out of step with itself) is skipped
        with a warning; an object left without one is not restored."""
        assert not self.objects and not self.space.segments, "restore into a pool in use"
        space = self.space
        # NOTE: the old master's readers may read ranges it freed, and its writers write the
        # ranges of its write slots, for as long as a lease (docs/ha.md: the consistency argument)
        usable_from = leased_until = now + lease_ttl_s
        for e in state.segments:
            # NOTE: a lease more than a heartbeat TTL: owners' calls to the dead master must
            # time out before their heartbeats reach this one
            space.heartbeat(e.node_id, usable_from)
            space.mount(
                e.node_id,
                e.name,
                e.tier,
                e.capacity,
                e.endpoint,
                e.alignment,
                e.token,
                usable_from=usable_from,
            )
        num = 0
        for o in state.objects:
            obj = ObjectRecord(
                key=o.key,
                size=o.size,
                writer="",
                started_at=now,
                is_committed=True,
                wanted=wanted,
                lease_until=leased_until,
                pin_ttl_s=o.pin_ttl_s,
            )
            for r in o.replicas:
                seg = space.segments.get(r.segment)
                if seg is None or not seg.allocator.allocate_at(r.offset, r.size):
                    log.warning(
                        "pool rebuild: replica %d of %r at %s+%d does not fit; skipped",
                        r.replica_id,
                        o.key,
                        r.segment,
                        r.offset,
                    )
                    continue
                space.tier_used[seg.tier] += seg.allocator.size_of(r.offset) or 0
                seg.keys.add(o.key)
                replica = Replica(seg, r.offset, r.size, COMPLETE, r.replica_id)
                obj.replicas.append(replica)
                self.order.add(o.key, seg.tier, o.size, obj.wanted)
            if not obj.replicas:
                continue
            self.objects[o.key] = obj
            fastest: dict[str, Replica] = {}  # node id -> its fastest replica
            for replica in sorted(obj.replicas, key=lambda r: -TIERS.index(r.tier)):
                fastest[replica.node_id] = replica
            for node_id, replica in fastest.items():
                self.emit("added", o.key, node_id, replica.tier)
            num += 1
        self.drain_changes()  # NOTE: what was restored is what the journal holds
        return num
