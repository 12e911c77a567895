"""Node liveness: what happens to the pool when a node stops heartbeating or a segment goes.

A node silent for heartbeat_ttl_s loses all its segments at once (one node_gone event).
Objects with a COMPLETE replica elsewhere keep being served from it; objects left with none
are gone (a lost event each). Puts whose writer died are reclaimed at once, other unended
puts after put_timeout_s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mooncake.store.objects import EventKind, Segment
from mooncake.store.slots import SLOT_KEY_PREFIX

if TYPE_CHECKING:
    from mooncake.store.metadata import MetadataService

log = logging.getLogger(__name__)


def expire_nodes(svc: MetadataService, now: float) -> list[str]:
    """Drop the nodes silent for heartbeat_ttl_s (node_gone; lost for objects left with
    no replica), reclaim abandoned puts and moves, free deferred ranges whose leases
    ended. Returns the ids of the dropped nodes."""
    dead = svc.space.dead_nodes(now, svc.config.heartbeat_ttl_s)
    for node_id in dead:
        silent_s = now - svc.space.node_last_seen[node_id]
        segments = list(svc.space.node_segments[node_id])
        for seg in segments:
            lose_segment(svc, seg, now, emit=None)
        svc.space.forget_node(node_id)
        svc.forget_instructions(node_id)
        if segments:  # a client without segments held nothing
            svc.emit("node_gone", "", node_id)
        log.warning("node %s sent no heartbeat for %.1f s: dropped", node_id, silent_s)
    unused_slots: dict[str, int] = {}  # writer -> write slots it never used
    for key in list(svc.writing):
        obj = svc.objects[key]
        if obj.writer in dead or now - obj.started_at > svc.config.put_timeout_s:
            if key.startswith(SLOT_KEY_PREFIX):  # held ahead and not needed: routine
                unused_slots[obj.writer] = unused_slots.get(obj.writer, 0) + 1
            else:
                log.warning("reclaiming put of %r by %r: never ended", key, obj.writer)
            svc.drop(obj, now, emit=None)
    for writer, n in unused_slots.items():
        # NOTE: debug: a writer holding slots ahead and not needing them is routine
        log.debug(
            "reclaimed %d write slots %r left unused for %g s", n, writer, svc.config.put_timeout_s
        )
    svc.mover.expire(now)
    svc.space.release_due(now)
    return dead


def lose_segment(svc: MetadataService, seg: Segment, now: float, emit: EventKind | None) -> int:
    """Detach every replica in `seg`, cancel moves through it, drop objects left without a
    replica (lost events for committed ones), then unmount it; returns the replicas dropped."""
    dropped = 0
    for key in list(seg.keys):
        obj = svc.objects[key]
        replica = next(r for r in obj.replicas if r.segment is seg)
        svc.mover.on_replica_lost(obj, replica, now)
        svc.detach(obj, replica, now, emit=emit, free=False)
        dropped += 1
        if obj.is_committed and not obj.complete():
            svc.counters.lost_objects += 1
            svc.drop(obj, now, emit=None)
            svc.emit("lost", key, seg.node_id, seg.tier)
        elif not obj.replicas:
            svc.drop(obj, now, emit=None)
    svc.space.unmount(seg)
    svc.changed_segments[seg.name] = None
    return dropped
