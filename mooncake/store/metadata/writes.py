"""The write protocol: how an object gets into the pool, and what may stop it.

put_start allocates `replicas` PROCESSING replicas on distinct nodes (the placement strategy
ranks segments; the first of the put's tiers with room wins, where eviction makes room at
once if it can, `Evictor.make_room`, before the next tier is tried; a put no tier takes
answers no_space; under local_first, a full writer's memory segment is made room on first,
`Evictor.room_on_writer`, its oldest objects relocated: the writer copies them, then
writes); the writer fills them; put_end commits (readers see the object) or
put_revoke abandons (the space is freed). A put never ended is reclaimed after
`put_timeout_s`, or at once when its writer's node expires (`membership.py`).

A put of a key that exists is refused (busy while another put is in flight, exists unless
it overwrites); an overwrite removes the old value first, under the same rule as remove
(`removal_refusal`: not while leased or moving). Write slots (`slots.py`) reuse
`clear_for_put` and `allocate_replicas` for the puts they stand in for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from mooncake.errors import StoreError
from mooncake.store.metadata.objects import (
    MEMORY_TIERS,
    TIERS,
    KeyResult,
    ObjectRecord,
    PutStartResult,
    Relocation,
    Replica,
    Segment,
    Tier,
)
from mooncake.store.metadata.settings import key_error

if TYPE_CHECKING:
    from mooncake.store.metadata.eviction import Evictor
    from mooncake.store.metadata.placement import BasePlacement
    from mooncake.store.metadata.pool import Pool
    from mooncake.store.metadata.settings import MetadataConfig


class WriteProtocol:
    """put_start / put_end / put_revoke over the pool's objects and segments, placing
    replicas by `placement` and making room through `evictor`."""

    def __init__(
        self, pool: Pool, placement: BasePlacement, evictor: Evictor, config: MetadataConfig
    ):
        self.pool = pool
        self.placement = placement
        self.evictor = evictor
        self.config = config

    def put_start(
        self,
        key: str,
        size: int,
        now: float,
        writer: str = "",
        replicas: int = 0,
        tiers: Sequence[str] = ("dram",),
        pin_ttl_s: float = 0.0,
        overwrite: bool = False,
    ) -> PutStartResult:
        """Check the request, make way for the key, allocate up to `replicas` (0 = config)
        PROCESSING replicas of `size` bytes on distinct nodes, trying `tiers` in order.
        Status ok (at least one replica), exists, busy (another put in flight), leased
        (overwrite of a leased object), no_space (retry after eviction ran), or error."""
        err = key_error(key) or (
            f"size of {key!r} must be > 0 bytes, got {size}" if size <= 0 else ""
        )
        bad = [t for t in tiers if t not in TIERS]
        if bad or not tiers:
            err = err or f"put of {key!r}: unknown tier(s) {bad or tiers!r}; use vram, dram, ssd"
        if err:
            return PutStartResult(key=key, status="error", message=err)
        refusal = self.clear_for_put(key, overwrite, now)
        if refusal:
            return PutStartResult(key=key, status=refusal.status, message=refusal.message)
        moved: list[tuple[ObjectRecord, Replica, Relocation]] = []
        chosen = self.allocate_replicas(key, size, writer, replicas, tiers, now, moved=moved)
        pool = self.pool
        if not chosen:
            for o, _, _ in moved:  # NOTE: never happens: the room made was the writer's
                pool.drop(o, now, emit=None)
            return PutStartResult(
                key=key,
                status="no_space",
                message=self._no_room(key, size, tiers),
                room_pending=any(
                    self.evictor.is_room_coming(t, now) for t in cast("list[Tier]", tiers)
                ),
            )
        obj = ObjectRecord(key, size, writer, now, chosen, pin_ttl_s=max(pin_ttl_s, 0.0))
        obj.wanted = replicas or self.config.replicas
        obj.relocations = [(o, dst) for o, dst, _ in moved]
        pool.start_writing(obj)
        return PutStartResult(
            key=key,
            status="ok",
            replicas=tuple(r.desc() for r in chosen),
            relocations=tuple(rel for _, _, rel in moved),
        )

    def clear_for_put(self, key: str, overwrite: bool, now: float) -> KeyResult | None:
        """None if the put may go ahead (an old value it overwrites is dropped), else why not:
        busy (a put or a tier move in flight), exists, or leased (a pin does not refuse it:
        it only shields from eviction)."""
        obj = self.pool.objects.get(key)
        if obj is None:
            return None
        if not obj.is_committed:
            msg = f"{key!r} is being written by {obj.writer or 'another client'}"
            return KeyResult(key=key, status="busy", message=msg)
        if not overwrite:
            msg = f"{key!r} already exists; pass overwrite=True to replace it"
            return KeyResult(key=key, status="exists", message=msg)
        refusal = removal_refusal(obj, now)
        if refusal:
            return refusal
        self.pool.drop(obj, now, emit="removed")
        return None

    def allocate_replicas(
        self,
        key: str,
        size: int,
        writer: str,
        replicas: int,
        tiers: Sequence[str],
        now: float,
        spare_only: bool = False,
        moved: list[tuple[ObjectRecord, Replica, Relocation]] | None = None,
    ) -> list[Replica]:
        """Replicas on distinct nodes, best ranked first, tier by tier: in each tier where
        there is no room for the first one, eviction makes some at once if it can
        (eviction.py) before the next tier is tried. `spare_only`: in the first tier only,
        and only under its high watermark (no eviction). `moved` (given): a full writer's
        memory segment is made room on first, the objects relocated added to it."""
        evictor = self.evictor
        want = replicas or self.config.replicas
        chosen: list[Replica] = []
        used_nodes: set[str] = set()
        order = cast("list[Tier]", list(tiers[:1] if spare_only else tiers))
        for tier in order:
            if spare_only and self._is_writer_full(size, writer, tier, now):
                return chosen  # NOTE: a slot elsewhere would dodge room_on_writer
            if moved is not None and not chosen and self._is_writer_full(size, writer, tier, now):
                moved += self.evictor.room_on_writer(
                    self._writer_segments(writer, tier, now)[0], size, key, now
                )
            self._place(key, size, writer, want, tier, now, spare_only, chosen, used_nodes)
            if not chosen and not spare_only and evictor.make_room(tier, size, now):
                self._place(key, size, writer, want, tier, now, False, chosen, used_nodes)
            if len(chosen) == want:
                break
        if not chosen and not spare_only:
            for tier in order:
                evictor.note_pressure(tier, size)
        return chosen

    def _writer_segments(self, writer: str, tier: Tier, now: float) -> list[Segment]:
        space = self.pool.space
        return [
            s
            for s in space.node_segments.get(writer, ())
            if s.tier == tier and s.usable_from <= now
        ]

    def _is_writer_full(self, size: int, writer: str, tier: Tier, now: float) -> bool:
        """Whether the put's first replica would leave its writer's full memory segment of
        `tier` while the placement keeps puts local (`Evictor.room_on_writer` makes room
        there instead)."""
        if not self.placement.keeps_local or tier not in MEMORY_TIERS:
            return False
        own = self._writer_segments(writer, tier, now)
        if not own or size > own[0].allocator.usable_bytes:
            return False
        return not any(s.allocator.can_fit(size) for s in own)

    def _place(
        self,
        key: str,
        size: int,
        writer: str,
        want: int,
        tier: Tier,
        now: float,
        spare_only: bool,
        chosen: list[Replica],
        used_nodes: set[str],
    ) -> None:
        """Add replicas in `tier` to `chosen` (on nodes not in `used_nodes`) up to `want`."""
        space, high = self.pool.space, self.config.high_watermark
        for seg in self.placement.rank(space.candidates(tier, size, used_nodes, now), writer):
            if len(chosen) == want:
                return
            if spare_only and space.share(tier, seg.allocator.aligned(size)) > high:
                return  # NOTE: the share is the tier's: no other segment is spare either
            replica = None if seg.node_id in used_nodes else space.allocate(seg, key, size)
            if replica is not None:
                chosen.append(replica)
                used_nodes.add(seg.node_id)

    def _no_room(self, key: str, size: int, tiers: Sequence[str]) -> str:
        where = "/".join(tiers)
        segs = [s for t in cast("list[Tier]", tiers) for s in self.pool.space.tier_segments[t]]
        largest = max((s.allocator.usable_bytes for s in segs), default=0)
        if size > largest:
            return (
                f"no {where} segment has {size} free bytes for {key!r}, even empty (the "
                f"largest holds {largest}); store smaller values or mount larger segments"
            )
        return (
            f"no {where} segment has {size} free bytes for {key!r}, and eviction could not "
            "make room: the objects there are in use (being written, read, moved or pinned) "
            "or wait for their demotion; retry in a moment, or give the pool more space"
        )

    def put_end(self, key: str, now: float) -> KeyResult:
        """Commit: mark the replicas COMPLETE (readable), put them in their tiers' LRU, emit
        added events. Repeating it is harmless."""
        pool = self.pool
        obj = pool.objects.get(key)
        if obj is None:
            return KeyResult(key=key, status="not_found", message=_unknown_put(key))
        if not obj.is_committed:
            obj.is_committed = True
            del pool.writing[key]
            obj.pin_until = now + obj.pin_ttl_s if obj.pin_ttl_s else 0.0
            for r in obj.replicas:
                pool.commit(obj, r)
            pool.settle_relocations(obj)
            pool.counters.puts += 1
        return KeyResult(key=key, status="ok")

    def put_revoke(self, key: str, now: float) -> KeyResult:
        """Abandon an uncommitted put and free its space (no events: readers never saw it)."""
        obj = self.pool.objects.get(key)
        if obj is None:
            return KeyResult(key=key, status="not_found", message=_unknown_put(key))
        if obj.is_committed:
            msg = f"put_revoke of {key!r}: the put was already committed; use remove"
            return KeyResult(key=key, status="error", message=msg)
        self.pool.drop(obj, now, emit=None)
        return KeyResult(key=key, status="ok")

    # -- batches: one result per key, in order -------------------------------------------

    def batch_put_start(
        self, keys: Sequence[str], sizes: Sequence[int], now: float, **kw: object
    ) -> list[PutStartResult]:
        if len(keys) != len(sizes):
            raise StoreError(f"batch put_start: {len(keys)} keys but {len(sizes)} sizes")
        return [self.put_start(k, s, now, **kw) for k, s in zip(keys, sizes, strict=True)]  # type: ignore[arg-type]

    def batch_put_end(self, keys: Sequence[str], now: float) -> list[KeyResult]:
        return [self.put_end(k, now) for k in keys]

    def batch_put_revoke(self, keys: Sequence[str], now: float) -> list[KeyResult]:
        return [self.put_revoke(k, now) for k in keys]


def removal_refusal(obj: ObjectRecord, now: float) -> KeyResult | None:
    """Why `obj` may not be removed or overwritten now (busy, leased), or None."""
    key = obj.key
    if not obj.is_committed:
        msg = f"{key!r} is being written; its writer must put_end or put_revoke it first"
        return KeyResult(key=key, status="busy", message=msg)
    if obj.move_id or obj.relocated_by:
        msg = f"{key!r} is moving between tiers or nodes; retry in a moment"
        return KeyResult(key=key, status="busy", message=msg)
    if obj.lease_until > now:
        left = obj.lease_until - now
        msg = f"{key!r} is leased by a reader for {left:.3f} s more; retry after that"
        return KeyResult(key=key, status="leased", message=msg)
    return None


def _unknown_put(key: str) -> str:
    return (
        f"no put of {key!r} is in progress: put_start was never called, or the put was "
        "revoked, or reclaimed after put_timeout_s; start the put again"
    )
