"""Node liveness: what happens to the pool when a node stops heartbeating or a segment goes.

Functions of the pool (`pool.py`) and the moves in flight (a lost replica cancels its move).
A node silent for heartbeat_ttl_s loses all its segments at once (one node_gone event).
Objects with a COMPLETE replica elsewhere keep being served from it; objects left with none
are gone (a lost event each). Puts whose writer died are reclaimed at once, other unended
puts after put_timeout_s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mooncake.store.metadata.objects import EventKind, Segment
from mooncake.store.metadata.slots import SLOT_KEY_PREFIX

if TYPE_CHECKING:
    from mooncake.store.metadata.moves import Mover
    from mooncake.store.metadata.pool import Pool
    from mooncake.store.metadata.settings import MetadataConfig

log = logging.getLogger(__name__)


def expire_nodes(pool: Pool, mover: Mover, config: MetadataConfig, now: float) -> list[str]:
    """Drop the nodes silent for heartbeat_ttl_s (node_gone; lost for objects left with
    no replica), reclaim abandoned puts and moves, free deferred ranges whose leases
    ended. Returns the ids of the dropped nodes."""
    space = pool.space
    dead = space.dead_nodes(now, config.heartbeat_ttl_s)
    for node_id in dead:
        silent_s = now - space.node_last_seen[node_id]
        segments = list(space.node_segments[node_id])
        for seg in segments:
            lose_segment(pool, mover, seg, now, emit=None)
        space.forget_node(node_id)
        pool.forget_instructions(node_id)
        if segments:  # a client without segments held nothing
            pool.emit("node_gone", "", node_id)
        log.warning("node %s sent no heartbeat for %.1f s: dropped", node_id, silent_s)
    unused_slots: dict[str, int] = {}  # writer -> write slots it never used
    for key in _abandoned(pool, dead, now - config.put_timeout_s):
        obj = pool.objects[key]
        if obj.writer in dead or obj.started_at < now - config.put_timeout_s:
            if key.startswith(SLOT_KEY_PREFIX):  # held ahead and not needed: routine
                unused_slots[obj.writer] = unused_slots.get(obj.writer, 0) + 1
            else:
                log.warning("reclaiming put of %r by %r: never ended", key, obj.writer)
            pool.drop(obj, now, emit=None)
    for writer, n in unused_slots.items():
        # NOTE: debug: a writer holding slots ahead and not needing them is routine
        log.debug(
            "reclaimed %d write slots %r left unused for %g s", n, writer, config.put_timeout_s
        )
    mover.expire(now)
    space.release_due(now)
    return dead


def _abandoned(pool: Pool, dead: list[str], started_before: float) -> list[str]:
    """The keys of the puts to look at: every one when a writer died (or the clock went
    back), else the oldest ones up to the first started at or after `started_before`: a
    tick then costs the puts it reclaims, not all those in flight (each client holds up to
    slots.MAX_RESERVE write slots ahead; with 32 clients, thousands, 20 ticks a second)."""
    if dead or not pool.is_writing_in_order:
        return list(pool.writing)
    out, objects = [], pool.objects
    for key in pool.writing:
        if objects[key].started_at >= started_before:
            break
        out.append(key)
    return out


def lose_segment(pool: Pool, mover: Mover, seg: Segment, now: float, emit: EventKind | None) -> int:
    """Detach every replica in `seg`, cancel moves through it, drop objects left without a
    replica (lost events for committed ones), then unmount it; returns the replicas dropped."""
    dropped = 0
    for key in list(seg.keys):
        obj = pool.objects[key]
        replica = next(r for r in obj.replicas if r.segment is seg)
        mover.on_replica_lost(obj, replica, now)
        pool.detach(obj, replica, now, emit=emit, free=False)
        dropped += 1
        if obj.is_committed and not obj.complete():
            pool.counters.lost_objects += 1
            pool.drop(obj, now, emit=None)
            pool.emit("lost", key, seg.node_id, seg.tier)
        elif not obj.replicas:
            pool.drop(obj, now, emit=None)
    pool.space.unmount(seg)
    pool.changed_segments[seg.name] = None
    return dropped
