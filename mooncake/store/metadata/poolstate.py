"""The pool's committed state as plain records: what survives a master restart or failover.

A mounted segment is a `SegmentEntry`, a committed object an `ObjectEntry` (its key, size
and committed replicas, each with its offset and its replica id). The metadata service
marks every segment mounted or gone and every key whose committed replicas changed (a
commit, a move, an eviction, a removal, a loss); `PoolChanges` carries them, each with its
new entry or None (gone), to a journal that makes them durable before the change is
answered (`store/journal.py`). A new master loads the entries and `restore`s them: the
segments as mounted (their nodes keep heartbeating them; a node that does not within
`lease_ttl_s + heartbeat_ttl_s` is expired as usual, its objects lost), the objects with
their old ranges taken again and their old replica ids, leased for `lease_ttl_s` (readers
of the old master may be copying), and no new allocation in those segments for
`lease_ttl_s` (writers of the old master's write slots and puts may still be writing).

Pure logic: no I/O, no threads, no clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from mooncake.store.metadata.objects import COMPLETE, TIERS, ObjectRecord, Replica, Segment, Tier

if TYPE_CHECKING:
    from mooncake.store.metadata.pool import Pool

log = logging.getLogger(__name__)


class SegmentEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A mounted segment, as its owner mounted it."""

    name: str
    node_id: str
    tier: Tier
    capacity: int  # bytes
    endpoint: str  # host:port of the owner's transfer server
    alignment: int  # bytes
    token: int  # the owner's Transfer Engine token of this registration


class ReplicaEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One committed replica: where its bytes are, and the id readers know it by."""

    segment: str
    offset: int  # bytes from the segment's start
    size: int  # bytes of the value
    replica_id: int  # unique per allocation (see ReplicaDesc.replica_id)


class ObjectEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One committed object."""

    key: str
    size: int  # bytes of the value
    replicas: tuple[ReplicaEntry, ...]  # committed replicas only
    pin_ttl_s: float = 0.0  # s, as put


class PoolState(msgspec.Struct, frozen=True, kw_only=True):
    """The whole committed pool: what a new master rebuilds from."""

    segments: tuple[SegmentEntry, ...] = ()
    objects: tuple[ObjectEntry, ...] = ()


@dataclass
class PoolChanges:
    """Changes since the last drain: name -> new entry, or None when it is gone."""

    segments: dict[str, SegmentEntry | None] = field(default_factory=dict)
    objects: dict[str, ObjectEntry | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.segments or self.objects)


def segment_entry(seg: Segment) -> SegmentEntry:
    return SegmentEntry(
        name=seg.name,
        node_id=seg.node_id,
        tier=seg.tier,
        capacity=seg.capacity,
        endpoint=seg.endpoint,
        alignment=seg.allocator.alignment,
        token=seg.token,
    )


def object_entry(obj: ObjectRecord | None) -> ObjectEntry | None:
    """The committed part of `obj`; None if it is not committed or has no committed replica."""
    if obj is None or not obj.is_committed:
        return None
    replicas = tuple(
        ReplicaEntry(segment=r.segment.name, offset=r.offset, size=r.size, replica_id=r.replica_id)
        for r in obj.replicas
        if r.state == COMPLETE
    )
    if not replicas:
        return None
    return ObjectEntry(key=obj.key, size=obj.size, replicas=replicas, pin_ttl_s=obj.pin_ttl_s)


def snapshot(pool: Pool) -> PoolState:
    """The pool's committed state, segments by name and objects by key (two pools with the
    same contents compare equal); changes nothing."""
    segs = sorted((segment_entry(s) for s in pool.space.segments.values()), key=lambda e: e.name)
    objs = [e for o in pool.objects.values() if (e := object_entry(o)) is not None]
    objs.sort(key=lambda e: e.key)
    return PoolState(segments=tuple(segs), objects=tuple(objs))


def restore(pool: Pool, state: PoolState, now: float, lease_ttl_s: float, wanted: int = 1) -> int:
    """Rebuild `pool` (which must be empty) from `state`; returns the objects restored.
    Restored objects are leased for `lease_ttl_s`, and count `wanted` copies as asked for.
    Every restored replica is announced (added events: the Conductor's prefix index).
    A replica whose range is not free (a journal out of step with itself) is skipped
    with a warning; an object left without one is not restored."""
    assert not pool.objects and not pool.space.segments, "restore into a pool in use"
    space = pool.space
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
            pool.order.add(o.key, seg.tier, o.size, obj.wanted)
        if not obj.replicas:
            continue
        pool.objects[o.key] = obj
        fastest: dict[str, Replica] = {}  # node id -> its fastest replica
        for replica in sorted(obj.replicas, key=lambda r: -TIERS.index(r.tier)):
            fastest[replica.node_id] = replica
        for node_id, replica in fastest.items():
            pool.emit("added", o.key, node_id, replica.tier)
        num += 1
    pool.drain_changes()  # NOTE: what was restored is what the journal holds
    return num
