"""What the metadata service keeps and hands out: segments, objects, replicas, results,
events for the Conductor and instructions for the data plane.

Internal records (`Segment`, `Replica`, `ObjectRecord`) are mutable and never leave the
service; what crosses a boundary is a frozen msgspec Struct (`ReplicaDesc`, `*Result`,
`StoreEvent`, `Instruction`, `StoreStats`), so the wire messages embed them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from mooncake.store.metadata.allocator import OffsetAllocator

Tier = Literal["vram", "dram", "ssd"]
TIERS: Final[tuple[Tier, ...]] = ("vram", "dram", "ssd")  # fastest first
MEMORY_TIERS: Final[tuple[Tier, ...]] = ("vram", "dram")
# Where a victim of a tier goes: the next tier down (None = dropped).
LOWER_TIER: Final[dict[Tier, Tier | None]] = {"vram": "dram", "dram": "ssd", "ssd": None}

PROCESSING: Final = "processing"  # allocated, being written; invisible to readers
COMPLETE: Final = "complete"  # committed; readable
ReplicaState = Literal["processing", "complete"]

# Result statuses. "ok", "exists", "not_found" and "no_space" are normal outcomes; "busy"
# and "leased" mean "not now" (retry later); "error" is a misuse the message explains.
Status = Literal["ok", "exists", "not_found", "no_space", "busy", "leased", "error"]
EventKind = Literal["added", "evicted", "removed", "demoted", "promoted", "node_gone", "lost"]
MAX_KEY_BYTES: Final = 256  # bytes of a key's UTF-8 encoding


class ReplicaDesc(msgspec.Struct, frozen=True, kw_only=True):
    """Where one copy of an object lives: what a client hands the Transfer Engine."""

    segment: str  # Transfer Engine segment name
    node_id: str  # the node that owns the segment
    endpoint: str  # host:port of the owner's transfer server; "" = resolve by name
    tier: Tier
    offset: int  # bytes from the segment's start
    size: int  # bytes of the value (the allocation may be larger by alignment)
    state: ReplicaState
    token: int = 0  # the segment's Transfer Engine token when mounted; 0 = not given
    # unique per allocation, never reused (a master restart starts from a random base):
    # a client that knew this replica id can tell it is still the same bytes
    # (store/client/grants.py)
    replica_id: int = 0


class Relocation(msgspec.Struct, frozen=True, kw_only=True):
    """An object the master moved off the writer's full segment to make the put room
    there (store/metadata/eviction.py, `room_on_writer`): the writer copies `src` to `dst` before
    it writes its own value (which may take `src`'s range); the put's end commits `dst`."""

    key: str  # the object moved
    src: ReplicaDesc  # where its bytes are until the writer's value overwrites them
    dst: ReplicaDesc  # where they go (PROCESSING until the put ends)


class PutStartResult(msgspec.Struct, frozen=True, kw_only=True):
    """put_start's answer: status "ok" with the replicas to write, or why not."""

    key: str
    status: Status
    message: str = ""  # what went wrong and what to do; "" when ok
    replicas: tuple[ReplicaDesc, ...] = ()  # status ok: write the value to every one
    # status ok: copy each of these first (a full writer's room, made by moving its oldest)
    relocations: tuple[Relocation, ...] = ()
    # status no_space: room is on its way (demotions in flight or about to start, ranges
    # freed when readers' leases end): the same put asked again soon may succeed
    room_pending: bool = False


class Slot(msgspec.Struct, frozen=True, kw_only=True):
    """Space reserved for the writer's next put of the same size (store/metadata/slots.py)."""

    slot_id: int
    replicas: tuple[ReplicaDesc, ...]  # write the value to every one, then commit
    ttl_s: float  # seconds from asking during which the slot may be written


class GetResult(msgspec.Struct, frozen=True, kw_only=True):
    """get_replicas' answer: the committed replicas (fastest and closest first), leased."""

    key: str
    status: Status  # "ok" (a hit), "not_found" (a miss), "error"
    message: str = ""
    size: int = 0  # bytes of the value
    replicas: tuple[ReplicaDesc, ...] = ()
    lease_ttl_s: float = 0.0  # seconds the object is safe from eviction and removal


class KeyResult(msgspec.Struct, frozen=True, kw_only=True):
    """The answer for one key of put_end, put_revoke, exists, remove, pin."""

    key: str
    status: Status
    message: str = ""


class StoreEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A change of the pool's contents, for the Conductor's global prefix index.

    Per node holding the object, in its fastest tier there (a node may keep an object in
    several tiers, e.g. DRAM and a copy on SSD; only a change of its fastest is an event):
    added (the node holds it now: put_end, a move's copy), evicted (the node holds it no
    more: eviction, unmount, a move's source released), removed (remove, overwrite),
    demoted / promoted (the node's fastest tier for it changed; `tier` is the new one). Per
    node: node_gone (key ""; the node's every replica went). Per object: lost (its last
    replica went with a node or segment; the object no longer exists).
    """

    kind: EventKind
    key: str  # "" for node_gone
    node_id: str
    tier: str = ""  # the replica's tier (after the move for demoted/promoted)


class Instruction(msgspec.Struct, frozen=True, kw_only=True):
    """A decision the data plane carries out, sent to the node owning `src`.

    evict: `src` was released (informational: the owner may discard the bytes).
    demote / copy / promote / replicate: copy `src` into `dst`, then confirm_move(move_id,
    ok); on success the service commits `dst` and (when `release_src`) releases `src`.
    """

    kind: Literal["evict", "demote", "copy", "promote", "replicate"]
    key: str
    src: ReplicaDesc
    dst: ReplicaDesc | None = None
    move_id: int = 0  # 0 for evict
    release_src: bool = False


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the service's counters, for metrics and `mooncake status`."""

    num_objects: int
    num_segments: int
    num_nodes: int
    tier_capacity_bytes: dict[str, int]  # tier -> bytes mounted
    tier_used_bytes: dict[str, int]  # tier -> bytes allocated
    tier_objects: dict[str, int]  # tier -> committed objects with a replica there
    hits: int
    tier_hits: dict[str, int] = {}  # tier -> hits whose first replica (the one read) is there
    misses: int
    puts: int  # committed puts
    removes: int
    evictions: int  # replicas dropped by eviction (the node kept no lower copy)
    demotions: int  # replicas moved down a tier, or dropped while their node keeps a copy lower
    promotions: int
    lost_objects: int  # objects gone with a node or segment
    replications: int = 0  # hot-spot copies to another node confirmed
    copies: int = 0  # copies to a lower tier made ahead of eviction (eviction.py)
    node_capacity_bytes: dict[str, dict[str, int]] = {}  # node id -> tier -> bytes mounted
    num_committed: int = 0  # objects readers see (num_objects counts puts in flight too)


@dataclass
class Counters:
    """Monotonic counters kept as plain ints; the master exports them to Prometheus."""

    hits: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    puts: int = 0
    removes: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    lost_objects: int = 0
    replications: int = 0
    copies: int = 0


@dataclass(eq=False)
class Segment:
    """One mounted segment: a node's memory (or SSD space) of one tier."""

    name: str
    node_id: str
    tier: Tier
    endpoint: str
    allocator: OffsetAllocator
    keys: set[str] = field(default_factory=set)  # keys with a replica here
    token: int = 0  # the owner's Transfer Engine token of this registration; 0 = none
    # s: no new allocation before then. A segment mounted again to a master that did not
    # know it (it restarted) may still be read and written by clients holding a previous
    # master's grants (read leases, write slots) until those run out.
    usable_from: float = 0.0
    mounted_at: float = 0.0  # s (the master's monotonic clock) of this registration

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def free_ratio(self) -> float:
        usable = self.allocator.usable_bytes
        return self.allocator.free_bytes / usable if usable else 0.0


@dataclass(eq=False)
class Replica:
    segment: Segment
    offset: int  # bytes
    size: int  # bytes of the value
    state: ReplicaState = PROCESSING
    replica_id: int = 0  # see ReplicaDesc.replica_id

    @property
    def node_id(self) -> str:
        return self.segment.node_id

    @property
    def tier(self) -> Tier:
        return self.segment.tier

    def desc(self) -> ReplicaDesc:
        s = self.segment
        return ReplicaDesc(
            segment=s.name,
            node_id=s.node_id,
            endpoint=s.endpoint,
            tier=s.tier,
            offset=self.offset,
            size=self.size,
            state=self.state,
            token=s.token,
            replica_id=self.replica_id,
        )


@dataclass(eq=False)
class ObjectRecord:
    """One key: its replicas and what protects it from eviction."""

    key: str
    size: int  # bytes of the value
    writer: str  # node id of the put's writer ("" if unknown)
    started_at: float  # s: put_start time, for reclaiming abandoned writes
    replicas: list[Replica] = field(default_factory=list)
    is_committed: bool = False  # put_end seen: readers see the COMPLETE replicas
    lease_until: float = 0.0  # s: readers may be copying until then
    pin_ttl_s: float = 0.0  # s: soft pin length, renewed on each read; 0 = not pinned
    pin_until: float = 0.0  # s
    move_id: int = 0  # a demotion/promotion in flight (its dst is a PROCESSING replica)
    wanted: int = 1  # copies the put asked for; more count against replica_budget
    # NOTE: a relocation (eviction.py, `room_on_writer`): the moved object's only replica
    # is its PROCESSING destination, written by the put `relocated_by` names, which keeps
    # (moved object, destination) in `relocations`; the moved object keeps its place in
    # the pool's order and reads as a miss until that put ends
    relocated_by: str = ""  # key of the put carrying this object's bytes; "" = none
    relocations: list[tuple[ObjectRecord, Replica]] = field(default_factory=list)

    def complete(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == COMPLETE]

    def is_protected(self, now: float) -> bool:
        """Leased, pinned, uncommitted, moving or relocated: eviction must skip it."""
        return (
            not self.is_committed
            or self.move_id != 0
            or bool(self.relocated_by)
            or self.lease_until > now
            or self.pin_until > now
        )
