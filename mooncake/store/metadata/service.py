"""The Store's metadata service: where every object's replicas live, and who may touch them.

Pure logic (no I/O, no threads, no clock: every call takes `now` in seconds), so the master,
the simulator and the tests run the same code. The master serves it over RPC
(`mooncake.store.server.messages`); clients then move bytes with the Transfer Engine straight to or
from the segment owners, never through the master.

Writes (`writes.py`): put_start allocates PROCESSING replicas on distinct nodes, the writer
fills them, put_end commits (readers see the object) or put_revoke abandons. A put never
ended is reclaimed after `put_timeout_s`, or at once when its writer's node expires.

Reads: get_replicas grants a lease of `lease_ttl_s` (renewed by every read): a leased
object is neither evicted nor removed. remove of a leased object is refused with status
"leased" (retry after the lease), not deferred: the caller learns at once that the key
still exists. A soft pin (`pin_ttl_s` on put, or `pin`) shields an object from eviction
until it goes `pin_ttl_s` without a read.

The state is one `Pool` (`pool.py`: segments, objects, puts in flight, the eviction order,
counters, pending events, instructions and journal changes); each protocol takes the pool
and the few collaborators it uses: writes (`writes.py`), write slots (`slots.py`),
eviction (`eviction.py`), tier moves (`moves.py`), node liveness (`membership.py`).
Callers use those directly (`svc.writes.put_start`, `svc.slots.commit`,
`svc.evictor.run`, `svc.mover.confirm`, `svc.space.heartbeat`, `svc.pool.drain_events`,
`svc.pool.snapshot()`, `audit.stats(svc.pool)`); this class builds and wires
them and keeps what composes several: mounts, expiry, reads, remove, pin, replicate,
restore and the integrity check.
Per-key operations answer with a result whose status says what happened (batch forms
answer per key); only segment and node misuse raises StoreError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mooncake.errors import StoreError
from mooncake.store.metadata import audit, membership
from mooncake.store.metadata.eviction import Evictor
from mooncake.store.metadata.moves import Mover
from mooncake.store.metadata.objects import (
    TIERS,
    GetResult,
    KeyResult,
    ObjectRecord,
    Replica,
)
from mooncake.store.metadata.placement import create_placement
from mooncake.store.metadata.pool import Pool
from mooncake.store.metadata.poolstate import PoolState
from mooncake.store.metadata.segments import SegmentManager
from mooncake.store.metadata.settings import MetadataConfig, key_error
from mooncake.store.metadata.slots import SlotBook
from mooncake.store.metadata.writes import WriteProtocol, removal_refusal

log = logging.getLogger(__name__)


def _read_order(r: Replica, reader: str) -> tuple[bool, bool, int]:
    # NOTE: memory anywhere beats the reader's own SSD; within memory, local beats remote.
    return r.tier == "ssd", r.node_id != reader, TIERS.index(r.tier)


class MetadataService:
    """Objects, replicas, leases and pins over the segments of `space`."""

    def __init__(self, config: MetadataConfig | None = None):
        self.config = config = config or MetadataConfig()
        self.space = SegmentManager(fit=config.fit)
        self.pool = pool = Pool(self.space)
        # NOTE: the pool's own containers, named here for readers and tests
        self.objects, self.writing, self.order = pool.objects, pool.writing, pool.order
        self.counters = pool.counters
        self.placement = create_placement(config.placement, config.seed)
        self.mover = Mover(pool, config)
        self.evictor = Evictor(pool, self.mover, config)
        self.writes = WriteProtocol(pool, self.placement, self.evictor, config)
        self.slots = SlotBook(pool, self.writes, config)
        pool.on_drop = self._forget

    # -- nodes and segments (misuse raises StoreError) -----------------------------------

    def mount_segment(
        self,
        node_id: str,
        name: str,
        tier: str,
        capacity: int,
        now: float,
        endpoint: str = "",
        alignment: int = 0,
        token: int = 0,
        is_remount: bool = False,
    ) -> None:
        """Add `capacity` bytes of `tier` owned by `node_id`; also a heartbeat. Mounting the
        same segment twice is a no-op; a conflicting mount raises StoreError.

        `token` names the registration: the same node mounting the segment with another
        token restarted, so the old one's objects are gone (lost events) before the new one
        is added. `is_remount`: the node mounted this memory with a previous master (this
        one restarted); nothing is placed in it for lease_ttl_s, while clients may still
        use that master's read leases and write slots on it."""
        self.space.heartbeat(node_id, now)
        old = self.space.segments.get(name)
        if old is not None and old.node_id == node_id and old.token != token:
            log.warning(
                "segment %s of node %s was registered again: its objects are gone", name, node_id
            )
            membership.lose_segment(self.pool, self.mover, old, now, emit="evicted")
        usable_from = now + self.config.lease_ttl_s if is_remount else 0.0
        if self.space.mount(
            node_id, name, tier, capacity, endpoint, alignment, token, usable_from, now
        ):
            self.pool.changed_segments[name] = None
            log.info("mounted %s segment %s of %d bytes on node %s", tier, name, capacity, node_id)

    def unmount_segment(self, node_id: str, name: str, now: float) -> int:
        """Drop a segment and its replicas (evicted events; lost for objects left with no
        replica); returns the number of replicas dropped. Raises StoreError if the node
        does not own such a segment."""
        seg = self.space.segments.get(name)
        if seg is None or seg.node_id != node_id:
            owner = f"node {seg.node_id!r}" if seg else "no node"
            raise StoreError(
                f"unmount of segment {name!r} by node {node_id!r}: {owner} has it mounted; "
                "nothing to unmount"
            )
        return membership.lose_segment(self.pool, self.mover, seg, now, emit="evicted")

    def drop_stale_segments(self, node_id: str, before: float, now: float) -> int:
        """Drop node `node_id`'s segments mounted before `before` (the master learned the
        node restarted: what its old process held is gone; what the new one mounted since
        stays); returns how many (lost events for objects left with no replica)."""
        stale = [s for s in self.space.node_segments.get(node_id, []) if s.mounted_at < before]
        for seg in stale:
            membership.lose_segment(self.pool, self.mover, seg, now, emit="evicted")
        return len(stale)

    def expire(self, now: float) -> list[str]:
        """Drop the nodes silent for heartbeat_ttl_s (node_gone; lost for objects left with
        no replica), reclaim abandoned puts and moves, free deferred ranges whose leases
        ended. Returns the ids of the dropped nodes."""
        return membership.expire_nodes(self.pool, self.mover, self.config, now)

    # -- reads and management ------------------------------------------------------------

    def get_replicas(self, key: str, now: float, reader: str = "") -> GetResult:
        """A hit: the committed replicas, memory before SSD, the reader's node first, then
        the fastest tier (an SSD replica is read as it is: the node serves its file); the
        object is leased for lease_ttl_s (so neither evicted nor removed while the reader
        copies), and one only on SSD starts a promotion to DRAM for the next reads. A miss:
        status not_found."""
        obj = self.objects.get(key)
        if obj is None or not obj.is_committed or obj.relocated_by:  # NOTE: relocating: a miss
            err = key_error(key)
            if err:
                return GetResult(key=key, status="error", message=err)
            self.counters.misses += 1
            return GetResult(key=key, status="not_found")
        self.counters.hits += 1
        ttl = self.config.lease_ttl_s
        obj.lease_until = max(obj.lease_until, now + ttl)
        if obj.pin_ttl_s:
            obj.pin_until = max(obj.pin_until, now + obj.pin_ttl_s)
        replicas = obj.complete()
        if len(replicas) > 1:
            replicas.sort(key=lambda r: _read_order(r, reader))
        self.order.touch(key)
        self.counters.tier_hits[replicas[0].tier] += 1
        if self.config.promote_on_hit and replicas[0].tier == "ssd" and not obj.move_id:
            # sorted: the first replica is on SSD only if every replica is
            self.evictor.promote(obj, reader, now)
        descs = tuple(r.desc() for r in replicas)
        return GetResult(key=key, status="ok", size=obj.size, replicas=descs, lease_ttl_s=ttl)

    def exists(self, key: str, now: float) -> KeyResult:
        """Status ok if `key` is committed, not_found otherwise; changes nothing."""
        obj = self.objects.get(key)
        if obj is not None and obj.is_committed:
            return KeyResult(key=key, status="ok")
        err = key_error(key)
        return KeyResult(key=key, status="error" if err else "not_found", message=err)

    def remove(self, key: str, now: float, force: bool = False) -> KeyResult:
        """Delete a committed object and free its space; refused (leased, busy) while a
        reader holds a lease (unless `force`), a put is in flight or a tier move is
        running. A pin does not block remove (it only shields from eviction).

        NOTE: `force` (upstream's `remove(key, force=True)`) drops a leased object at once;
        its range is still freed only when the lease ends, so a reader copying it meanwhile
        reads the old bytes."""
        obj = self.objects.get(key)
        if obj is None:
            err = key_error(key)
            return KeyResult(key=key, status="error" if err else "not_found", message=err)
        refusal = removal_refusal(obj, now)
        if refusal and not (force and refusal.status == "leased"):
            return refusal
        self.pool.drop(obj, now, emit="removed")
        self.counters.removes += 1
        return KeyResult(key=key, status="ok")

    def pin(self, key: str, ttl_s: float, now: float) -> KeyResult:
        """Soft-pin a committed object for ttl_s, renewed by reads; ttl_s 0 unpins."""
        obj = self.objects.get(key)
        if obj is None:
            return KeyResult(key=key, status="error" if key_error(key) else "not_found")
        obj.pin_ttl_s = max(ttl_s, 0.0)
        obj.pin_until = now + obj.pin_ttl_s if obj.pin_ttl_s else 0.0
        return KeyResult(key=key, status="ok")

    # -- batches: one result per key, in order -------------------------------------------

    def batch_get_replicas(
        self, keys: Sequence[str], now: float, reader: str = ""
    ) -> list[GetResult]:
        return [self.get_replicas(k, now, reader) for k in keys]

    def batch_exists(self, keys: Sequence[str], now: float) -> list[KeyResult]:
        return [self.exists(k, now) for k in keys]

    def batch_remove(self, keys: Sequence[str], now: float, force: bool = False) -> list[KeyResult]:
        return [self.remove(k, now, force) for k in keys]

    def remove_all(self, now: float, force: bool = False) -> int:
        """Remove every committed object that `remove` would (leased ones too when
        `force`); returns how many went."""
        keys = [k for k, obj in self.objects.items() if obj.is_committed]
        return sum(self.remove(k, now, force).status == "ok" for k in keys)

    def clear_replicas(self, keys: Sequence[str], writer: str, where: str, now: float) -> list[str]:
        """Upstream's BatchReplicaClear (mooncake-store/src/master_service.cpp): of `keys`
        put by `writer` and removable now (no reader's lease, not being written or moved),
        drop every replica (`where` "") or the committed ones on the segment `where` names
        (its segment name, its node id or its endpoint "host:port"), the object with its
        last one; returns the keys cleared, in order. Keys missing, put by another node,
        leased, busy or without a replica there are skipped."""
        cleared = []
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or obj.writer != writer or removal_refusal(obj, now) is not None:
                continue
            there = [
                r
                for r in obj.complete()
                if where in (r.segment.name, r.node_id, r.segment.endpoint)
            ]
            if where and not there:
                continue
            if not where or len(there) == len(obj.replicas):
                self.pool.drop(obj, now, emit="removed")
                self.counters.removes += 1
            else:
                for r in there:
                    self.pool.detach(obj, r, now, emit="removed")
            cleared.append(key)
        return cleared

    # -- moves, restore, integrity -------------------------------------------------------

    def replicate(self, keys: Sequence[str], dst_node: str, now: float) -> int:
        """Start copying each committed key to `dst_node`'s DRAM (hot-spot replication:
        Conductor decisions); keys missing, moving, already there or without room there are
        skipped. Returns how many copies started; each commits when the source's owner
        confirms it (an added event)."""
        started = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is not None and self.mover.replicate(obj, dst_node, now):
                started += 1
        return started

    def restore(self, state: PoolState, now: float) -> int:
        """Rebuild this service (which must be empty) from `state` (Pool.restore);
        returns the objects restored."""
        cfg = self.config
        return self.pool.restore(state, now, cfg.lease_ttl_s, cfg.replicas)

    def check_integrity(self) -> None:
        """Assert the objects, replicas, order, segments, slots and moves all agree."""
        audit.check_pool(self.pool)
        self.slots.check_integrity()
        self.mover.check_integrity()

    def _forget(self, obj: ObjectRecord) -> None:
        """`obj` is being dropped: its tier move and its write slot go with it."""
        if obj.move_id:
            self.mover.cancel(obj.move_id)
        self.slots.forget(obj.key)
