"""Eviction and tier moves: keeping each tier under its watermark without losing objects
that have somewhere to go.

A pass (`run`) looks at the tiers fastest first. A tier whose used share is above the high
watermark (or where a put just found no room: "pressure") gives up victims in LRU order,
skipping leased, pinned, uncommitted and moving objects, until its share would be under the
low watermark (and the pressured put would fit). For each victim, the replicas in that tier:

    | victim has a replica in another tier | what happens                                   |
    |--------------------------------------|------------------------------------------------|
    | yes                                  | dropped (evicted events, evict instructions)   |
    | no, a lower tier has room            | one demoted (move), the others dropped         |
    | no, nowhere to go                    | dropped: the object leaves the pool            |

Lower tiers: vram -> dram -> ssd; ssd victims are dropped. A move allocates the destination
as a PROCESSING replica (the same node preferred) and instructs the source's owner to copy;
`confirm` commits the copy and releases the source (after readers' leases). A read of an
object found only on SSD starts a promotion back to DRAM the same way, when DRAM is under
its high watermark; so does a hot-spot replication (`replicate`: a copy to another node's
DRAM, the source kept). Decisions are data (Instructions, StoreEvents) queued on the service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mooncake.store.objects import (
    COMPLETE,
    LOWER_TIER,
    TIERS,
    EventKind,
    Instruction,
    KeyResult,
    ObjectRecord,
    Replica,
    Segment,
    Tier,
)

if TYPE_CHECKING:
    from mooncake.store.metadata import MetadataService


MoveKind = Literal["demote", "promote", "replicate"]


@dataclass(eq=False)
class Move:
    """A copy between tiers in flight: `dst` is PROCESSING until confirmed."""

    move_id: int
    kind: MoveKind
    key: str
    src: Replica
    dst: Replica
    release_src: bool  # the source is released once the copy is confirmed
    started_at: float  # s


_DONE: dict[str, EventKind] = {"demote": "demoted", "promote": "promoted"}


def _aligned(r: Replica) -> int:
    return r.segment.allocator.aligned(r.size)


class Evictor:
    """Eviction passes and the moves they (and promotions) start."""

    def __init__(self, svc: MetadataService):
        self.svc = svc
        self.moves: dict[int, Move] = {}  # move id -> move
        self.pressure: dict[Tier, int] = {}  # tier -> largest size a put found no room for
        self._next_move_id = 1

    def note_pressure(self, tier: Tier, size: int) -> None:
        """A put of `size` bytes found no room in `tier`: the next pass makes some."""
        self.pressure[tier] = max(self.pressure.get(tier, 0), size)

    # -- eviction ------------------------------------------------------------------------

    def run(self, now: float) -> int:
        """One pass over every tier; returns the number of victim objects."""
        self.svc.space.release_due(now)  # ranges whose readers' leases ended
        victims = 0
        for tier in TIERS:
            chosen = self._choose(tier, now)
            for obj in chosen:
                self._evict(obj, tier, now)
            victims += len(chosen)
        return victims

    def _choose(self, tier: Tier, now: float) -> list[ObjectRecord]:
        space, cfg = self.svc.space, self.svc.config
        need = self.pressure.pop(tier, 0)
        usable = space.tier_usable[tier]
        used = space.tier_used[tier] - self._pending_release(tier)
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
        svc = self.svc
        here = [r for r in obj.replicas if r.tier == tier]
        kept = None
        lower = LOWER_TIER[tier]
        if lower is not None and len(here) == len(obj.replicas):
            chain: tuple[Tier, ...] = ("dram", "ssd") if tier == "vram" else ("ssd",)
            kept = self._start_move(obj, here, "demote", chain, "", now)
        for r in here:
            if r is not kept:
                desc = r.desc()
                svc.detach(obj, r, now, emit="evicted")
                svc.counters.evictions += 1
                svc.instruct(r.node_id, Instruction(kind="evict", key=obj.key, src=desc))
        if not obj.replicas:
            svc.drop(obj, now, emit=None)

    def _pending_release(self, tier: Tier) -> int:
        """Bytes of `tier` that confirmed moves will free."""
        return sum(
            _aligned(m.src) for m in self.moves.values() if m.release_src and m.src.tier == tier
        )

    # -- moves ---------------------------------------------------------------------------

    def promote(self, obj: ObjectRecord, reader: str, now: float) -> bool:
        """Start copying an SSD-only object back to DRAM; False if DRAM has no room under
        its high watermark."""
        sources = sorted(obj.complete(), key=lambda r: r.node_id != reader)
        return self._start_move(obj, sources, "promote", ("dram",), reader, now) is not None

    def replicate(self, obj: ObjectRecord, dst_node: str, now: float) -> bool:
        """Start copying a committed object's memory replica to `dst_node`'s DRAM (a hot
        spot, Algorithm 1); False if it is moving, already there, or has no room there
        under the high watermark."""
        if obj.move_id or not obj.is_committed or any(r.node_id == dst_node for r in obj.replicas):
            return False
        sources = [r for r in obj.complete() if r.tier != "ssd"]
        return self._start_move(obj, sources, "replicate", ("dram",), dst_node, now) is not None

    def _start_move(
        self,
        obj: ObjectRecord,
        sources: Sequence[Replica],
        kind: MoveKind,
        tiers: Sequence[Tier],
        prefer: str,
        now: float,
    ) -> Replica | None:
        """Allocate a destination for one of `sources` in the first of `tiers` with room,
        on the source's node if possible, else a node without a replica; queue the copy.
        Returns the source chosen, or None."""
        svc, space = self.svc, self.svc.space
        holders = {r.node_id for r in obj.replicas}
        high = svc.config.high_watermark
        for src in sources:
            for tier in tiers:
                cands = space.candidates(tier, obj.size, holders - {src.node_id}, now)
                if kind == "replicate":  # a copy for that node, nowhere else
                    cands = [s for s in cands if s.node_id == prefer]
                if kind != "demote":  # never copy up into a tier that must then evict
                    cands = [
                        s for s in cands if space.share(tier, s.allocator.aligned(obj.size)) <= high
                    ]
                dst = self._allocate(cands, src.node_id, prefer, obj.key, obj.size)
                if dst is None:
                    continue
                release = kind == "demote" or (kind == "promote" and dst.node_id == src.node_id)
                move_id, self._next_move_id = self._next_move_id, self._next_move_id + 1
                self.moves[move_id] = Move(move_id, kind, obj.key, src, dst, release, now)
                obj.move_id = move_id
                obj.replicas.append(dst)
                svc.instruct(
                    src.node_id,
                    Instruction(
                        kind=kind,
                        key=obj.key,
                        src=src.desc(),
                        dst=dst.desc(),
                        move_id=move_id,
                        release_src=release,
                    ),
                )
                return src
        return None

    def _allocate(
        self, cands: list[Segment], node: str, prefer: str, key: str, size: int
    ) -> Replica | None:
        cands.sort(key=lambda s: (s.node_id != node, s.node_id != prefer, -s.free_ratio, s.name))
        for seg in cands:
            dst = self.svc.space.allocate(seg, key, size)
            if dst is not None:
                return dst
        return None

    def confirm(self, move_id: int, ok: bool, now: float) -> KeyResult:
        """Commit (ok) or abandon a move; not_found if it was cancelled meanwhile."""
        svc = self.svc
        mv = self.moves.pop(move_id, None)
        if mv is None:
            msg = (
                f"move {move_id} is unknown: already confirmed, or cancelled (a node or the "
                "object went, or it ran past put_timeout_s); discard the copy"
            )
            return KeyResult(key="", status="not_found", message=msg)
        obj = svc.objects[mv.key]
        obj.move_id = 0
        if not ok:
            svc.detach(obj, mv.dst, now, emit=None)
            return KeyResult(key=mv.key, status="ok", message="move abandoned; the source stays")
        mv.dst.state = COMPLETE
        svc.lru[mv.dst.tier][mv.key] = None
        same_node = mv.src.node_id == mv.dst.node_id
        if mv.release_src:
            svc.detach(obj, mv.src, now, emit=None if same_node else "evicted")
        if same_node and mv.release_src:
            svc.emit(_DONE[mv.kind], mv.key, mv.dst.node_id, mv.dst.tier)
        else:
            svc.emit("added", mv.key, mv.dst.node_id, mv.dst.tier)
        if mv.kind == "demote":
            svc.counters.demotions += 1
        elif mv.kind == "promote":
            svc.counters.promotions += 1
        else:
            svc.counters.replications += 1
        return KeyResult(key=mv.key, status="ok")

    def on_replica_lost(self, obj: ObjectRecord, replica: Replica, now: float) -> None:
        """`replica`'s segment is going: cancel a move it takes part in (freeing the
        destination when the source, and so the mover's data, is gone)."""
        mv = self.moves.get(obj.move_id) if obj.move_id else None
        if mv is None or replica not in (mv.src, mv.dst):
            return
        self.cancel(mv.move_id)
        if replica is mv.src:
            self.svc.detach(obj, mv.dst, now, emit=None)

    def cancel(self, move_id: int) -> None:
        """Forget a move; the caller deals with its destination replica."""
        mv = self.moves.pop(move_id)
        self.svc.objects[mv.key].move_id = 0

    def expire_moves(self, now: float) -> None:
        """Abandon moves unconfirmed for put_timeout_s (their destination is freed)."""
        timeout = self.svc.config.put_timeout_s
        for mv in [m for m in self.moves.values() if now - m.started_at > timeout]:
            self.cancel(mv.move_id)
            self.svc.detach(self.svc.objects[mv.key], mv.dst, now, emit=None)

    def check_integrity(self) -> None:
        """Assert every move matches its object: source COMPLETE, destination PROCESSING."""
        moving = {k for k, o in self.svc.objects.items() if o.move_id}
        assert moving == {m.key for m in self.moves.values()}, "moves out of sync with objects"
        for move_id, mv in self.moves.items():
            obj = self.svc.objects[mv.key]
            assert obj.move_id == move_id and obj.is_committed, f"move {move_id}: bad object"
            assert mv.src in obj.replicas and mv.src.state == COMPLETE, f"move {move_id}: src"
            assert mv.dst in obj.replicas and mv.dst.state != COMPLETE, f"move {move_id}: dst"
