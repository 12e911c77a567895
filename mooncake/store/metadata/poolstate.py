"""The pool's committed state as plain records: what survives a master restart or failover.

A mounted segment is a `SegmentEntry`, a committed object an `ObjectEntry` (its key, size
and committed replicas, each with its offset and its replica id). The metadata service
marks every segment mounted or gone and every key whose committed replicas changed (a
commit, a move, an eviction, a removal, a loss); `PoolChanges` carries them, each with its
new entry or None (gone), to a journal that makes them durable before the change is
answered (`store/metadata/journal.py`). A new master loads the entries and `Pool.restore`s them: the
segments as mounted (their nodes keep heartbeating them; a node that does not within
`lease_ttl_s + heartbeat_ttl_s` is expired as usual, its objects lost), the objects with
their old ranges taken again and their old replica ids, leased for `lease_ttl_s` (readers
of the old master may be copying), and no new allocation in those segments for
`lease_ttl_s` (writers of the old master's write slots and puts may still be writing).

Pure logic: no I/O, no threads, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mooncake.store.metadata.objects import COMPLETE, ObjectRecord, Segment, Tier


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
