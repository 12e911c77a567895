"""Tier moves: copies of an object's bytes that the data plane makes and then confirms.

A move allocates its destination as a PROCESSING replica (on the source's node if it can,
else on a node without a replica) and instructs the source's owner to copy; `confirm`
commits the copy and, for a demotion, releases the source (after readers' leases).

    | kind      | from -> to                | the source after the copy                  |
    |-----------|---------------------------|--------------------------------------------|
    | demote    | a victim -> a lower tier  | released                                   |
    | copy      | memory -> a lower tier    | kept: the object is clean (eviction.py)    |
    | promote   | SSD -> DRAM, on a hit     | kept: the SSD copy stays clean             |
    | replicate | memory -> another node    | kept (a hot spot, Algorithm 1)             |

Promotions and replications never copy into a tier above its high watermark (they must
not make it evict); demotions and copies go down whatever the share there (the lower
tier's own pass evicts). An object has at most one move in flight, and a moving object is
protected from eviction and removal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mooncake.store.metadata.objects import (
    COMPLETE,
    Instruction,
    KeyResult,
    ObjectRecord,
    Replica,
    Segment,
    Tier,
)

if TYPE_CHECKING:
    from mooncake.store.metadata.pool import Pool
    from mooncake.store.metadata.settings import MetadataConfig


MoveKind = Literal["demote", "copy", "promote", "replicate"]


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


class Mover:
    """The moves in flight, by id."""

    def __init__(self, pool: Pool, config: MetadataConfig):
        self.pool = pool
        self.config = config
        self.moves: dict[int, Move] = {}  # move id -> move
        self._next_move_id = 1

    def pending_release(self, tier: Tier) -> int:
        """Bytes of `tier` that confirmed moves will free."""
        return sum(
            m.src.segment.allocator.aligned(m.src.size)
            for m in self.moves.values()
            if m.release_src and m.src.tier == tier
        )

    def replicate(self, obj: ObjectRecord, dst_node: str, now: float) -> bool:
        """Start copying a committed object's memory replica to `dst_node`'s DRAM (a hot
        spot, Algorithm 1); False if it is moving, already there, has no room there under
        the high watermark, or the copy would pass DRAM's `replica_budget`."""
        if obj.move_id or not obj.is_committed or any(r.node_id == dst_node for r in obj.replicas):
            return False
        pool, budget = self.pool, self.config.replica_budget
        in_flight = sum(m.dst.size for m in self.moves.values() if m.kind == "replicate")
        usable = pool.space.tier_usable["dram"]
        if not pool.order.may_duplicate("dram", in_flight + obj.size, budget, usable):
            return False
        sources = [r for r in obj.complete() if r.tier != "ssd"]
        return self.start(obj, sources, "replicate", ("dram",), dst_node, now) is not None

    def start(
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
        pool, space = self.pool, self.pool.space
        holders = {r.node_id for r in obj.replicas}
        high = self.config.high_watermark
        for src in sources:
            for tier in tiers:
                cands = space.candidates(tier, obj.size, holders - {src.node_id}, now)
                cands = [s for s in cands if not _holds(obj, s.node_id, tier)]
                if kind == "replicate":  # a copy for that node, nowhere else
                    cands = [s for s in cands if s.node_id == prefer]
                if kind in ("promote", "replicate"):  # never up into a tier that must evict
                    cands = [
                        s for s in cands if space.share(tier, s.allocator.aligned(obj.size)) <= high
                    ]
                dst = self._allocate(cands, src.node_id, prefer, obj.key, obj.size)
                if dst is None:
                    continue
                release = kind == "demote"
                move_id, self._next_move_id = self._next_move_id, self._next_move_id + 1
                self.moves[move_id] = Move(move_id, kind, obj.key, src, dst, release, now)
                obj.move_id = move_id
                obj.replicas.append(dst)
                pool.instruct(
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
            dst = self.pool.space.allocate(seg, key, size)
            if dst is not None:
                return dst
        return None

    def confirm(self, move_id: int, ok: bool, now: float) -> KeyResult:
        """Commit (ok) or abandon a move; not_found if it was cancelled meanwhile."""
        pool = self.pool
        mv = self.moves.pop(move_id, None)
        if mv is None:
            msg = (
                f"move {move_id} is unknown: already confirmed, or cancelled (a node or the "
                "object went, or it ran past put_timeout_s); discard the copy"
            )
            return KeyResult(key="", status="not_found", message=msg)
        obj = pool.objects[mv.key]
        obj.move_id = 0
        if not ok:
            pool.detach(obj, mv.dst, now, emit=None)
            return KeyResult(key=mv.key, status="ok", message="move abandoned; the source stays")
        pool.commit(obj, mv.dst)
        if mv.release_src:  # NOTE: after the gain: a node keeping it lower is a demotion
            pool.detach(obj, mv.src, now, emit="evicted")
        if mv.kind == "demote":
            pool.counters.demotions += 1
        elif mv.kind == "copy":
            pool.counters.copies += 1
        elif mv.kind == "promote":
            pool.counters.promotions += 1
        else:
            pool.counters.replications += 1
        return KeyResult(key=mv.key, status="ok")

    def on_replica_lost(self, obj: ObjectRecord, replica: Replica, now: float) -> None:
        """`replica`'s segment is going: cancel a move it takes part in (freeing the
        destination when the source, and so the mover's data, is gone)."""
        mv = self.moves.get(obj.move_id) if obj.move_id else None
        if mv is None or replica not in (mv.src, mv.dst):
            return
        self.cancel(mv.move_id)
        if replica is mv.src:
            self.pool.detach(obj, mv.dst, now, emit=None)

    def cancel(self, move_id: int) -> None:
        """Forget a move; the caller deals with its destination replica."""
        mv = self.moves.pop(move_id)
        self.pool.objects[mv.key].move_id = 0

    def expire(self, now: float) -> None:
        """Abandon moves unconfirmed for put_timeout_s (their destination is freed)."""
        timeout = self.config.put_timeout_s
        for mv in [m for m in self.moves.values() if now - m.started_at > timeout]:
            self.cancel(mv.move_id)
            self.pool.detach(self.pool.objects[mv.key], mv.dst, now, emit=None)

    def check_integrity(self) -> None:
        """Assert every move matches its object: source COMPLETE, destination PROCESSING."""
        moving = {k for k, o in self.pool.objects.items() if o.move_id}
        assert moving == {m.key for m in self.moves.values()}, "moves out of sync with objects"
        for move_id, mv in self.moves.items():
            obj = self.pool.objects[mv.key]
            assert obj.move_id == move_id and obj.is_committed, f"move {move_id}: bad object"
            assert mv.src in obj.replicas and mv.src.state == COMPLETE, f"move {move_id}: src"
            assert mv.dst in obj.replicas and mv.dst.state != COMPLETE, f"move {move_id}: dst"


def _holds(obj: ObjectRecord, node_id: str, tier: Tier) -> bool:
    """Whether `obj` already has a replica in `tier` on `node_id`."""
    return any(r.node_id == node_id and r.tier == tier for r in obj.replicas)
