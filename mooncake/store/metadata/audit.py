"""Read-only views of the pool's state (`pool.py`): a stats snapshot, the check of a write
against its allocation, and the integrity check that tests run after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake.store.metadata.objects import COMPLETE, TIERS, StoreStats

if TYPE_CHECKING:
    from mooncake.store.metadata.pool import Pool


def stats(pool: Pool) -> StoreStats:
    """A snapshot of the counters and per-tier totals."""
    c, space = pool.counters, pool.space
    per_node: dict[str, dict[str, int]] = {}
    for seg in space.segments.values():
        tiers = per_node.setdefault(seg.node_id, {})
        tiers[seg.tier] = tiers.get(seg.tier, 0) + seg.allocator.usable_bytes
    return StoreStats(
        num_objects=len(pool.objects),
        num_committed=len(pool.objects) - len(pool.writing),
        num_segments=len(space.segments),
        num_nodes=len(space.node_last_seen),
        tier_capacity_bytes={t: space.tier_usable[t] for t in TIERS},
        tier_used_bytes={t: space.tier_used[t] for t in TIERS},
        tier_objects={t: pool.order.count(t) for t in TIERS},
        hits=c.hits,
        tier_hits=dict(c.tier_hits),
        misses=c.misses,
        puts=c.puts,
        removes=c.removes,
        evictions=c.evictions,
        demotions=c.demotions,
        promotions=c.promotions,
        replications=c.replications,
        copies=c.copies,
        lost_objects=c.lost_objects,
        node_capacity_bytes=per_node,
    )


def check_pool(pool: Pool) -> None:
    """Assert the objects, replicas, eviction order and segments all agree."""
    space = pool.space
    space.check_integrity()
    seg_keys: dict[str, set[str]] = {name: set() for name in space.segments}
    taken: dict[str, set[int]] = {name: set() for name in space.segments}
    if pool.is_writing_in_order:  # NOTE: expiry stops at the first put not timed out
        starts = [pool.objects[k].started_at for k in pool.writing]
        assert starts == sorted(starts), f"puts in flight out of start order: {starts}"
    for key, obj in pool.objects.items():
        assert obj.key == key and obj.replicas, f"{key}: empty or misfiled record"
        assert (key in pool.writing) != obj.is_committed, f"{key}: writing list wrong"
        done = obj.complete()
        where = {(r.node_id, r.tier) for r in done}
        assert len(where) == len(done), f"{key}: two replicas in one tier of a node"
        if obj.relocated_by:
            assert obj.is_committed and len(obj.replicas) == 1 and not done, key
            put = pool.objects.get(obj.relocated_by)
            assert put is not None and any(o is obj for o, _ in put.relocations), key
        elif obj.is_committed:
            assert done, f"{key}: committed without a COMPLETE replica"
            assert len(obj.replicas) - len(done) == (1 if obj.move_id else 0), key
        else:
            assert not done and not obj.move_id, f"{key}: uncommitted but readable"
        for r in obj.replicas:
            seg = space.segments.get(r.segment.name)
            assert seg is r.segment, f"{key}: replica in unmounted segment {r.segment.name}"
            assert seg.allocator.size_of(r.offset) == seg.allocator.aligned(r.size), key
            assert key not in seg_keys[seg.name], f"{key}: two replicas in {seg.name}"
            seg_keys[seg.name].add(key)
            taken[seg.name].add(r.offset)
    pool.order.check_integrity()
    for key, obj in pool.objects.items():
        per: dict[str, int] = {}
        # NOTE: a relocated object keeps its place in the order through its move
        for r in obj.replicas if obj.relocated_by else obj.complete():
            per[r.tier] = per.get(r.tier, 0) + 1
        assert pool.order.copies.get(key, {}) == per, f"{key}: eviction order out of sync"
    for _, r in space.deferred:
        assert r.offset not in taken[r.segment.name], "deferred range also in use"
        taken[r.segment.name].add(r.offset)
    for name, seg in space.segments.items():
        assert seg.keys == seg_keys[name], f"segment {name}: key set out of sync"
        assert set(seg.allocator.allocations()) == taken[name], f"{name}: leaked ranges"


def write_error(pool: Pool, key: str, segment: str, offset: int, length: int) -> str:
    """Why writing [offset, offset+length) of `segment` for `key` is not allowed ("" if
    it is: the range lies inside one of the key's PROCESSING replicas)."""
    obj = pool.objects.get(key)
    for r in obj.replicas if obj else ():
        if r.segment.name == segment and r.state != COMPLETE:
            if r.offset <= offset and offset + length <= r.offset + r.size and length > 0:
                return ""
            return (
                f"write to {key!r} in segment {segment!r} at [{offset}, {offset + length}) "
                f"is outside its allocation [{r.offset}, {r.offset + r.size})"
            )
    return f"no put of {key!r} is in progress in segment {segment!r}; call put_start first"
