"""Wire messages of the Store's metadata service, and the handlers that answer them.

Every request is a `*Msg` with a `store.*` tag; its reply embeds the service's own result
structs (`PutStartResult`, `GetResult`, `KeyResult`), so a batch reply is a tuple of the
same per-key results. Decoding enforces the size limits below before the service sees a
request; the service then checks what a type cannot (a key's UTF-8 length, tiers).

Per-key outcomes (a miss, no room, a leased key, an unknown put) are statuses in the reply.
Segment misuse (unmount of a segment the node does not own, a conflicting mount) raises
StoreError, which the RPC server sends back as an error reply; the service goes on.

The master wires it with `register(server, service, clock=time.monotonic, lock=lock)`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Annotated, Any, Final, Literal

from msgspec import Meta

from mooncake.rpc.wire import Msg
from mooncake.store.metadata import audit
from mooncake.store.metadata.objects import (
    MAX_KEY_BYTES,
    GetResult,
    Instruction,
    KeyResult,
    PutStartResult,
    Slot,
    StoreStats,
)
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.slots import MAX_RESERVE, SlotSpec

MAX_BATCH: Final = 4096  # keys per batch request
MAX_VALUE_BYTES: Final = 1 << 40  # bytes of one object
MAX_REPLICAS: Final = 16

Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[tuple[Key, ...], Meta(max_length=MAX_BATCH)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]  # node id or segment name
OptName = Annotated[str, Meta(max_length=256)]  # "" = unknown / none
ValueSize = Annotated[int, Meta(gt=0, le=MAX_VALUE_BYTES)]  # bytes
TierName = Literal["vram", "dram", "ssd"]
Tiers = Annotated[tuple[TierName, ...], Meta(min_length=1, max_length=3)]
Replicas = Annotated[int, Meta(ge=0, le=MAX_REPLICAS)]  # 0 = the master's default
Seconds = Annotated[float, Meta(ge=0, le=86400 * 365)]


# -- nodes and segments ------------------------------------------------------------------


class MountSegmentMsg(Msg, frozen=True, tag="store.mount_segment"):
    """A node offers `capacity_bytes` of one tier; also counts as a heartbeat."""

    node_id: Name
    segment: Name  # Transfer Engine segment name, unique in the cluster
    tier: TierName
    capacity_bytes: Annotated[int, Meta(gt=0, le=1 << 50)]
    endpoint: Annotated[str, Meta(max_length=300)] = ""  # host:port of its transfer server
    alignment: Annotated[int, Meta(ge=0, le=1 << 20)] = 0  # bytes; 0 = tier default
    token: Annotated[int, Meta(ge=0)] = 0  # the registration's engine token (u64)
    is_remount: bool = False  # this memory was mounted with an earlier master


class UnmountSegmentMsg(Msg, frozen=True, tag="store.unmount_segment"):
    node_id: Name
    segment: Name


class HeartbeatMsg(Msg, frozen=True, tag="store.heartbeat"):
    node_id: Name


class AckMsg(Msg, frozen=True, tag="store.ack"):
    """Reply to mount, unmount and release_slots."""

    num_replicas_dropped: int = 0  # unmount: replicas that lived in the segment; release: slots


class HeartbeatReplyMsg(Msg, frozen=True, tag="store.heartbeat_reply"):
    is_known: bool  # False: the master had forgotten this node; re-mount its segments
    instructions: tuple[Instruction, ...] = ()  # work for this node (moves, evictions)
    # names of this node's segments the master has mounted (None: an older master); the
    # node mounts again any of its own not listed, which `is_known` alone cannot tell when
    # the reply to the heartbeat that re-registered it was lost (a link outage)
    mounted: tuple[Name, ...] | None = None


class ConfirmMoveMsg(Msg, frozen=True, tag="store.confirm_move"):
    """A node finished (ok) or failed a demote/promote instruction."""

    move_id: Annotated[int, Meta(ge=1)]
    ok: bool


class StatsMsg(Msg, frozen=True, tag="store.stats"):
    pass


class DirectPortMsg(Msg, frozen=True, tag="store.direct_port"):
    """Which port of the master's host serves the direct channel (see store/server/direct.py)."""


class DirectPortReplyMsg(Msg, frozen=True, tag="store.direct_port_reply"):
    port: int = 0  # 0 = none: use the RPC for every call
    host: str = ""  # where it listens; "" = the RPC address's host


class StatsReplyMsg(Msg, frozen=True, tag="store.stats_reply"):
    stats: StoreStats


# -- objects -----------------------------------------------------------------------------


class PutStartMsg(Msg, frozen=True, tag="store.put_start"):
    key: Key
    size_bytes: ValueSize
    node_id: OptName = ""  # the writer's node (local-first placement, reclaim on death)
    replicas: Replicas = 0
    tiers: Tiers = ("dram",)  # tiers to try, in order
    pin_ttl_s: Seconds = 0.0  # soft pin after commit, renewed by reads; 0 = none
    overwrite: bool = False
    reserve: Annotated[int, Meta(ge=0, le=MAX_RESERVE)] = 0  # write slots to add (slots.py)


class BatchPutStartMsg(Msg, frozen=True, tag="store.batch_put_start"):
    keys: Keys
    sizes_bytes: Annotated[tuple[ValueSize, ...], Meta(max_length=MAX_BATCH)]
    node_id: OptName = ""
    replicas: Replicas = 0
    tiers: Tiers = ("dram",)
    pin_ttl_s: Seconds = 0.0
    overwrite: bool = False
    # write slots to add, when every value has the same size (slots.py)
    reserve: Annotated[int, Meta(ge=0, le=MAX_RESERVE)] = 0


class PutStartReplyMsg(Msg, frozen=True, tag="store.put_start_reply"):
    result: PutStartResult
    slots: tuple[Slot, ...] = ()  # the write slots reserved for the writer's next puts


class BatchPutSlotMsg(Msg, frozen=True, tag="store.batch_put_slot"):
    """Commit each key's value written into its write slot (slot_ids[i] for keys[i]):
    the second round trip of a put or put_batch that used slots (store/metadata/slots.py)."""

    keys: Keys
    slot_ids: Annotated[tuple[Annotated[int, Meta(ge=1)], ...], Meta(max_length=MAX_BATCH)]
    node_id: OptName = ""
    pin_ttl_s: Seconds = 0.0
    overwrite: bool = False
    refill: Annotated[int, Meta(ge=0, le=MAX_RESERVE)] = 0  # new slots like them to reserve


class BatchPutSlotReplyMsg(Msg, frozen=True, tag="store.batch_put_slot_reply"):
    results: tuple[KeyResult, ...]
    slots: tuple[Slot, ...] = ()


class ReleaseSlotsMsg(Msg, frozen=True, tag="store.release_slots"):
    """Give back unused write slots (a client closing)."""

    slot_ids: Annotated[tuple[Annotated[int, Meta(ge=1)], ...], Meta(max_length=MAX_BATCH)]
    node_id: OptName = ""


class BatchPutStartReplyMsg(Msg, frozen=True, tag="store.batch_put_start_reply"):
    results: tuple[PutStartResult, ...]
    slots: tuple[Slot, ...] = ()  # the write slots reserved for the writer's next batches


class PutEndMsg(Msg, frozen=True, tag="store.put_end"):
    key: Key


class BatchPutEndMsg(Msg, frozen=True, tag="store.batch_put_end"):
    keys: Keys


class PutRevokeMsg(Msg, frozen=True, tag="store.put_revoke"):
    key: Key


class BatchPutRevokeMsg(Msg, frozen=True, tag="store.batch_put_revoke"):
    keys: Keys


class GetReplicasMsg(Msg, frozen=True, tag="store.get_replicas"):
    key: Key
    node_id: OptName = ""  # the reader's node: its replicas come first


class BatchGetReplicasMsg(Msg, frozen=True, tag="store.batch_get_replicas"):
    keys: Keys
    node_id: OptName = ""


class GetReplicasReplyMsg(Msg, frozen=True, tag="store.get_replicas_reply"):
    result: GetResult


class BatchGetReplicasReplyMsg(Msg, frozen=True, tag="store.batch_get_replicas_reply"):
    results: tuple[GetResult, ...]


class ExistsMsg(Msg, frozen=True, tag="store.exists"):
    key: Key


class BatchExistsMsg(Msg, frozen=True, tag="store.batch_exists"):
    keys: Keys


class RemoveMsg(Msg, frozen=True, tag="store.remove"):
    key: Key
    force: bool = False  # remove it even while a reader's lease lasts


class BatchRemoveMsg(Msg, frozen=True, tag="store.batch_remove"):
    keys: Keys
    force: bool = False


class RemoveAllMsg(Msg, frozen=True, tag="store.remove_all"):
    """Remove every committed object (upstream's `remove_all`)."""

    force: bool = False  # leased objects too


class RemoveAllReplyMsg(Msg, frozen=True, tag="store.remove_all_reply"):
    num_removed: int  # objects removed


class ClearReplicasMsg(Msg, frozen=True, tag="store.clear_replicas"):
    """Upstream's BatchReplicaClear: drop the replicas of the keys `node_id` put, once no
    reader's lease protects them; all of them, or those on `segment` (MetadataService
    .clear_replicas)."""

    keys: Keys
    node_id: Name  # the writer: only its objects are cleared
    segment: OptName = ""  # "" every replica; else a segment name, node id or "host:port"


class ClearReplicasReplyMsg(Msg, frozen=True, tag="store.clear_replicas_reply"):
    cleared: Keys  # the keys cleared, in the request's order


class PinMsg(Msg, frozen=True, tag="store.pin"):
    key: Key
    ttl_s: Seconds  # 0 unpins


class KeyReplyMsg(Msg, frozen=True, tag="store.key_reply"):
    result: KeyResult


class BatchKeyReplyMsg(Msg, frozen=True, tag="store.batch_key_reply"):
    results: tuple[KeyResult, ...]


# -- serving -----------------------------------------------------------------------------


def _put_start(s: MetadataService, m: PutStartMsg, now: float) -> Msg:
    r = s.writes.put_start(
        m.key, m.size_bytes, now, m.node_id, m.replicas, m.tiers, m.pin_ttl_s, m.overwrite
    )
    if not m.reserve or r.status != "ok":
        return PutStartReplyMsg(r)
    spec = SlotSpec(m.node_id, m.replicas, m.tiers)
    return PutStartReplyMsg(r, tuple(s.slots.reserve(m.size_bytes, m.reserve, spec, now)))


def _batch_put_start(s: MetadataService, m: BatchPutStartMsg, now: float) -> Msg:
    opts = {"writer": m.node_id, "replicas": m.replicas, "tiers": m.tiers}
    opts |= {"pin_ttl_s": m.pin_ttl_s, "overwrite": m.overwrite}
    results = tuple(s.writes.batch_put_start(m.keys, m.sizes_bytes, now, **opts))
    sizes = set(m.sizes_bytes)
    if not m.reserve or len(sizes) != 1 or not any(r.status == "ok" for r in results):
        return BatchPutStartReplyMsg(results)
    spec = SlotSpec(m.node_id, m.replicas, m.tiers)
    return BatchPutStartReplyMsg(results, tuple(s.slots.reserve(sizes.pop(), m.reserve, spec, now)))


def _batch_put_slot(s: MetadataService, m: BatchPutSlotMsg, now: float) -> Msg:
    results, slots = s.slots.commit_many(
        m.keys, m.slot_ids, m.node_id, now, m.pin_ttl_s, m.overwrite, m.refill
    )
    return BatchPutSlotReplyMsg(tuple(results), slots)


def _heartbeat(s: MetadataService, m: HeartbeatMsg, now: float) -> Msg:
    is_known = s.space.heartbeat(m.node_id, now)
    mounted = tuple(seg.name for seg in s.space.node_segments.get(m.node_id, ()))
    return HeartbeatReplyMsg(is_known, tuple(s.pool.drain_instructions(m.node_id)), mounted)


def _mount(s: MetadataService, m: MountSegmentMsg, now: float) -> Msg:
    s.mount_segment(
        m.node_id,
        m.segment,
        m.tier,
        m.capacity_bytes,
        now,
        m.endpoint,
        m.alignment,
        m.token,
        m.is_remount,
    )
    return AckMsg()


_HANDLERS: dict[type, Callable[[MetadataService, Any, float], Msg]] = {
    MountSegmentMsg: _mount,
    UnmountSegmentMsg: lambda s, m, now: AckMsg(s.unmount_segment(m.node_id, m.segment, now)),
    HeartbeatMsg: _heartbeat,
    ConfirmMoveMsg: lambda s, m, now: KeyReplyMsg(s.mover.confirm(m.move_id, m.ok, now)),
    StatsMsg: lambda s, m, now: StatsReplyMsg(audit.stats(s.pool)),
    PutStartMsg: _put_start,
    BatchPutStartMsg: _batch_put_start,
    PutEndMsg: lambda s, m, now: KeyReplyMsg(s.writes.put_end(m.key, now)),
    BatchPutSlotMsg: _batch_put_slot,
    ReleaseSlotsMsg: lambda s, m, now: AckMsg(s.slots.release(m.slot_ids, m.node_id, now)),
    BatchPutEndMsg: lambda s, m, now: BatchKeyReplyMsg(tuple(s.writes.batch_put_end(m.keys, now))),
    PutRevokeMsg: lambda s, m, now: KeyReplyMsg(s.writes.put_revoke(m.key, now)),
    BatchPutRevokeMsg: lambda s, m, now: BatchKeyReplyMsg(
        tuple(s.writes.batch_put_revoke(m.keys, now))
    ),
    GetReplicasMsg: lambda s, m, now: GetReplicasReplyMsg(s.get_replicas(m.key, now, m.node_id)),
    BatchGetReplicasMsg: lambda s, m, now: BatchGetReplicasReplyMsg(
        tuple(s.batch_get_replicas(m.keys, now, m.node_id))
    ),
    ExistsMsg: lambda s, m, now: KeyReplyMsg(s.exists(m.key, now)),
    BatchExistsMsg: lambda s, m, now: BatchKeyReplyMsg(tuple(s.batch_exists(m.keys, now))),
    RemoveMsg: lambda s, m, now: KeyReplyMsg(s.remove(m.key, now, m.force)),
    BatchRemoveMsg: lambda s, m, now: BatchKeyReplyMsg(tuple(s.batch_remove(m.keys, now, m.force))),
    RemoveAllMsg: lambda s, m, now: RemoveAllReplyMsg(s.remove_all(now, m.force)),
    ClearReplicasMsg: lambda s, m, now: ClearReplicasReplyMsg(
        tuple(s.clear_replicas(m.keys, m.node_id, m.segment, now))
    ),
    PinMsg: lambda s, m, now: KeyReplyMsg(s.pin(m.key, m.ttl_s, now)),
}
REQUEST_TYPES: Final = tuple(_HANDLERS)  # every request type the master serves


def handle(service: MetadataService, msg: Msg, now: float) -> Msg:
    """Apply one request to `service` and return its reply. Raises StoreError for segment
    misuse; per-key outcomes are statuses inside the reply."""
    fn = _HANDLERS.get(type(msg))
    assert fn is not None, f"no store handler for {type(msg).__name__}"
    return fn(service, msg, now)


def register(
    server: Any,
    service: MetadataService,
    clock: Callable[[], float],
    lock: AbstractContextManager[Any] | None = None,
    after: Callable[[Msg], int] | None = None,
    wait: Callable[[int], None] | None = None,
) -> None:
    """Register a handler for every request type on an `RpcServer`; each call reads
    `clock()` for `now` and runs under `lock` (shared with the master's eviction and
    expiry loop; the RPC server itself calls handlers one at a time), then `after(msg)`
    under the same lock (it queues the journal's changes and returns a ticket); the reply
    goes once `wait(ticket)` returns, off the lock (store/metadata/groupcommit.py)."""
    guard = lock if lock is not None else nullcontext()

    def serve(msg: Msg, peer: Any) -> Msg:
        with guard:
            reply = handle(service, msg, clock())
            ticket = after(msg) if after is not None else 0
        if ticket and wait is not None:
            wait(ticket)
        return reply

    for msg_type in REQUEST_TYPES:
        server.register(msg_type, serve)
