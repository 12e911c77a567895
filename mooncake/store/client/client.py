"""The Store's client API, for our prefill/decode nodes and for other engines.

    store = Store.connect("tcp://10.0.0.1:7100", secret)
    store.put("block-1", kv_bytes, replicas=2)
    data = store.get("block-1")                  # bytes, or NotFoundError / StoreError
    buf = store.register_buffer("kv", array)     # zero-copy: the engine moves bytes in place
    store.put_from("block-2", "kv", offset, size); store.get_into("block-2", "kv", offset)
    results = store.put_batch(keys, values)      # per-key KeyResult / ValueResult
    store.close()

Metadata goes to the master (put_start / put_end / get_replicas), on its direct channel
when it offers one (store/server/direct.py: no ZeroMQ thread hops), else over the RPC; bytes go
through this client's Transfer Engine straight to or from the node owning each replica
(store/client/datapath.py), never through the master. Round trips per call, once warm:

    put, put_from   2: write into a write slot (store/metadata/slots.py), commit it
    get, get_into   1 while the last read's lease lasts (store/client/grants.py), else 2
    put_batch       2 when every value has the same size (a slot each, one commit), else 3
    get_batch       1 lookup for the keys not read within their lease, then all reads at once

Every failure raises StoreError with what happened and what to do; a miss raises
NotFoundError. One class, `Store`: single keys, batches (a result per key), values
written in place by several writers (start_puts / end_puts), then the helpers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from mooncake.errors import MooncakeError, StoreError, TransferError
from mooncake.rpc.client import RpcClient
from mooncake.rpc.wire import Msg
from mooncake.store.client.datapath import DataPath, ReadPlan, WritePlan
from mooncake.store.client.grants import MARGIN, LocationCache, PutShape, SlotPool
from mooncake.store.client.relocator import Relocator
from mooncake.store.metadata.objects import GetResult, KeyResult, PutStartResult, ReplicaDesc, Slot
from mooncake.store.metadata.settings import key_error
from mooncake.store.server import messages as m
from mooncake.store.server.direct import MasterCalls
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.inline import Finish
from mooncake.transfer.staging import BaseStaging, Event
from mooncake.transfer.types import EngineOptions

__all__ = ["NotFoundError", "StatusError", "Store", "ValueResult"]


# (key, slot taken from the pool with its deadline, local segment, offset in it)
SlotEntry = tuple[str, tuple[Slot, float], str, int]


@dataclasses.dataclass
class _Located:
    """Where the keys of a batch read are (Store._find)."""

    found: dict[str, tuple[list[ReplicaDesc], int] | ValueResult]  # key -> (replicas, bytes)
    cold: set[str]  # keys the master was asked about (the others were within a lease)
    sent_at: float  # s (monotonic) when it was asked
    ttl: float  # s of the read lease it granted


class NotFoundError(StoreError):
    """The key has no committed object in the pool."""


class StatusError(StoreError):
    """A key's outcome other than ok or a miss: `status` says which (exists, no_space,
    busy, leased, error), for callers that answer with codes (store/upstream/codes.py)."""

    def __init__(self, message: str, status: str):
        super().__init__(message)
        self.status = status


class ValueResult(msgspec.Struct, frozen=True, kw_only=True):
    """One key of get_batch: status "ok" with `value`, or why not."""

    key: str
    status: str  # "ok", "not_found", "too_large" (for its buffer: get_batch_into) or "error"
    message: str = ""
    value: bytes | None = None  # the object's bytes when ok (get_batch)
    size: int = 0  # bytes of the value when ok

    def unwrap(self) -> bytes:
        """The value; raises NotFoundError or StoreError when the key had none."""
        if self.value is not None:
            return self.value
        raise (NotFoundError if self.status == "not_found" else StoreError)(self.message)


class Store:
    """A connection to the pool: a control channel to the master and a Transfer Engine."""

    def __init__(
        self,
        master: RpcClient,
        engine: TransferEngine,
        timeout_s: float,
        staging: int,
        *,
        direct: bool = True,
        reuse_grants: bool = True,
        put_wait_s: float = 5.0,
        put_retry_s: float = 0.01,
    ):
        """`direct`: make the calls on the master's direct channel when it offers one
        (store/server/direct.py); False keeps every call on the CURVE-encrypted RPC.
        `reuse_grants`: reuse read leases and write slots (store/client/grants.py); False asks
        the master on every call, as a client of upstream Mooncake does. `put_wait_s`,
        `put_retry_s`: [store]'s, how long a put waits for room on its way."""
        self.master, self.engine, self.timeout_s = master, engine, timeout_s
        self.put_wait_s, self.put_retry_s = put_wait_s, put_retry_s
        self.node_id = engine.name
        self.data = DataPath(engine, self.node_id, timeout_s)
        self.locations = LocationCache() if reuse_grants else None
        self.slots = SlotPool() if reuse_grants else None
        self._calls = MasterCalls(master, timeout_s, direct, engine.options.spin_us * 1e-6)
        self._lock = threading.Lock()  # NOTE: guards the staging buffer, one op at a time
        self._staging_name = f"{self.node_id}.staging"
        self._staging = engine.allocate(self._staging_name, staging)
        self.relocator = Relocator(engine, self.data, f"{self.node_id}.moving")

    @classmethod
    def connect(
        cls,
        master_address: str,
        secret: bytes | str,
        *,
        node_id: str = "",  # this node's id: its own replicas are read first
        host: str = "127.0.0.1",  # address of this client's data-plane server
        timeout_s: float = 10.0,  # seconds per master call and per transfer batch
        staging_bytes: int = 16 << 20,  # bytes of the buffer behind put()/get(); grows
        engine_options: EngineOptions | None = None,
        direct: bool = True,  # use the master's direct channel if it offers one
        reuse_grants: bool = True,  # reuse read leases and write slots (store/client/grants.py)
        nic_preference: Mapping[str, Any] | None = None,  # Topology.nic_preference
        staging: BaseStaging | None = None,  # device memory over tcp/shm; None = CUDA's
        put_wait_s: float = 5.0,  # s a put waits for room on its way ([store] put_wait_s)
        put_retry_s: float = 0.01,  # s between its asks ([store] put_retry_s)
    ) -> Store:
        """Connect to the master at `master_address` (e.g. "tcp://10.0.0.1:7100")."""
        key = secret.encode() if isinstance(secret, str) else secret
        name = node_id or f"client-{uuid.uuid4().hex[:12]}"
        engine = TransferEngine(
            name, key, engine_options, host=host, nic_preference=nic_preference, staging=staging
        )
        try:
            master = RpcClient(master_address, key, timeout_s=timeout_s, max_frame_bytes=64 << 20)
            return cls(
                master,
                engine,
                timeout_s,
                staging_bytes,
                direct=direct,
                reuse_grants=reuse_grants,
                put_wait_s=put_wait_s,
                put_retry_s=put_retry_s,
            )
        except BaseException:
            engine.close()
            raise

    def register_buffer(self, name: str, buffer: Any, location: str | None = None) -> None:
        """Register `buffer` (numpy array, torch tensor, bytearray) for put_from/get_into."""
        self.engine.register(name, buffer, location)

    def unregister_buffer(self, name: str) -> None:
        self.engine.unregister(name)

    def close(self) -> None:
        """Give back unused write slots (best effort) and close the connections."""
        if self.slots is not None and (ids := self.slots.drain()):
            with contextlib.suppress(MooncakeError):
                self._call(m.ReleaseSlotsMsg(tuple(ids), self.node_id), m.AckMsg)
        self._calls.close()
        self.master.close()
        self.engine.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- single keys -------------------------------------------------------------------------

    def put(self, key: str, value: bytes | memoryview, **opts: Any) -> None:
        """Store `value` under `key`. Options: replicas (0 = master default), pin_ttl_s,
        overwrite, tiers. Raises StoreError (exists, no space, a failed write...)."""
        with self._lock:
            self._stage(len(value))
            self._staging[: len(value)] = np.frombuffer(value, dtype=np.uint8)
            self.put_from(key, self._staging_name, 0, len(value), **opts)

    def put_from(
        self,
        key: str,
        segment: str,
        offset: int,
        size: int,
        *,
        ready: Event | None = None,
        **opts: Any,
    ) -> None:
        """Zero-copy put of `size` bytes at `offset` of registered buffer `segment`. When
        `segment` is device memory, the bytes are read once `ready` (the CUDA event after
        the kernels that wrote them) completed; without it, once the work queued so far on
        this thread's current stream of that device did."""
        region = self.engine.segments.get(segment)
        if ready is None and region is not None and region.view.mv is None:
            ready = self.engine.stager.staging.record(region.location)
        if ready is not None:
            ready.synchronize()  # NOTE: the NIC or the staging copy must not read it sooner
        self._check_size(key, size)
        key = self._key(key)
        self._forget_locations([key])
        shape = PutShape.of(size, opts)
        taken = self.slots.take(shape, time.monotonic()) if self.slots is not None else None
        if taken is not None:
            return self._raise(
                self._put_into_slots(shape, [(key, taken, segment, offset)], opts)[0]
            )
        reserve = self.slots.want(size) if self.slots is not None else 0
        sent_at = time.monotonic()
        reply = self._call(
            m.PutStartMsg(key, size, self.node_id, **opts, reserve=reserve), m.PutStartReplyMsg
        )
        if self.slots is not None and reply.slots:
            self.slots.add(shape, reply.slots, sent_at)
        r = self._wait_for_room([reply.result], [size], opts)[0]
        self._raise(r)
        failed = self.relocator.copy([r]) or self.data.write([(key, r.replicas, segment, offset)])
        if failed:
            self._revoke([key])
            raise StoreError(f"put of {key!r} failed, nothing was committed: {failed[key]}")
        self._raise(self._call(m.PutEndMsg(key), m.KeyReplyMsg).result)
        self._learn(key, r.replicas)

    def get(self, key: str) -> bytes:
        """The value of `key`. Raises NotFoundError on a miss, StoreError on failure."""
        with self._lock:
            size = self._get(key, self._staging_name, 0, 0, staging=True)
            return self._staging[:size].tobytes()

    def get_into(self, key: str, segment: str, offset: int, max_size: int = 0) -> int:
        """Zero-copy read of `key` into registered `segment` at `offset`; returns its size.
        Raises StoreError when the value is larger than `max_size` (0 = no limit)."""
        return self._get(self._key(key), segment, offset, max_size)

    def _get(
        self, key: str, segment: str, offset: int, max_size: int, staging: bool = False
    ) -> int:
        """Read `key` into `segment` at `offset`; returns its size. Within a lease: one
        round trip, to the node. Else, when this client knows where the value was (a hint:
        its own put, a read whose lease ended), it reads there while it asks the master,
        and keeps those bytes if the master's answer still lists that replica: the two
        round trips overlap. On failure the buffer's bytes are unspecified."""
        cache = self.locations
        guess: tuple[ReplicaDesc, Finish] | None = None  # a hinted read under way
        if cache is not None:
            fits = len(self._staging) if staging else max_size or 1 << 62
            if (hit := cache.get(key, time.monotonic())) and hit[1] <= fits:
                try:
                    self.data.read_one(hit[0], segment, offset, hit[1])
                    return hit[1]
                except TransferError:
                    cache.drop(key)  # moved or gone: ask the master
            elif (hint := cache.guess(key)) and hint[1] <= fits:
                finish = self.data.start_read(hint[0], segment, offset, hint[1])
                guess = None if finish is None else (hint[0], finish)
        sent_at = time.monotonic()
        try:
            r = self._get_replicas(key)
        except BaseException:
            if guess is not None:
                guess[1](False)  # NOTE: always end it: here without waiting
            raise
        kept = self._still_there(guess, r) if guess is not None else None
        if guess is not None and not guess[1](kept is not None):
            kept = None  # NOTE: a replica the master does not list: abandoned unread
        if max_size and r.size > max_size:
            why = f"{key!r} is {r.size} bytes; the buffer offers {max_size}"
            raise StatusError(why, "error")
        if kept is not None and cache is not None and self._in_lease(r, sent_at):
            cache.put(key, kept, r.size, sent_at, r.lease_ttl_s)
            cache.num_overlapped += 1
            return r.size
        if staging:
            self._stage(r.size)
        used = self.data.read(key, r.replicas, segment, offset, r.size)
        if self.locations is not None:
            self.locations.put(key, used, r.size, sent_at, r.lease_ttl_s)
        return r.size

    def exists(self, key: str) -> bool:
        r = self._call(m.ExistsMsg(self._key(key)), m.KeyReplyMsg).result
        if r.status not in ("ok", "not_found"):
            self._raise(r)
        return r.status == "ok"

    def remove(self, key: str, *, force: bool = False, wait: bool = True) -> None:
        """Remove `key`, waiting up to timeout_s for readers' leases to end (`wait` False:
        ask once); NotFoundError if absent, StatusError if still leased (or busy) by then; a
        pin does not block it. `force`: remove it even while leased."""
        self._forget_locations([key])
        deadline = time.monotonic() + self.timeout_s
        while True:
            r = self._call(m.RemoveMsg(self._key(key), force), m.KeyReplyMsg).result
            if r.status != "leased" or not wait or time.monotonic() > deadline:
                return self._raise(r)
            time.sleep(0.02)

    def remove_all(self, force: bool = False) -> int:
        """Remove every committed object not leased (`force`: leased ones too); returns
        how many went. Objects being written or moved stay."""
        return self._call(m.RemoveAllMsg(force), m.RemoveAllReplyMsg).num_removed

    def clear_replicas(self, keys: Sequence[str], where: str = "") -> list[str]:
        """Drop the replicas of those `keys` this client put whose readers' leases have
        ended: all of them (`where` ""), or those on the segment `where` names (a segment
        name, a node id or an endpoint "host:port"); returns the keys cleared. Keys that
        are missing, another client's, leased, being written or have no replica there
        are skipped (upstream's batch_replica_clear)."""
        self._forget_locations(keys)
        cleared: list[str] = []
        for start in range(0, len(keys), m.MAX_BATCH):
            part = tuple(self._key(k) for k in keys[start : start + m.MAX_BATCH])
            msg = m.ClearReplicasMsg(part, self.node_id, where)
            cleared += self._call(msg, m.ClearReplicasReplyMsg).cleared
        return cleared

    # -- batches: one result per key, in order -----------------------------------------------

    def put_batch(
        self, keys: Sequence[str], values: Sequence[bytes | memoryview], **opts: Any
    ) -> list[KeyResult]:
        """Put every key; returns one KeyResult per key (status ok or why not)."""
        if len(keys) != len(values):
            raise StoreError(f"put_batch: {len(keys)} keys but {len(values)} values")
        sizes = [len(v) for v in values]
        with self._lock:  # NOTE: the staging buffer holds the values until they are written
            self._stage(sum(sizes))
            sources, off = [], 0
            for v in values:
                self._staging[off : off + len(v)] = np.frombuffer(v, dtype=np.uint8)
                sources.append((self._staging_name, off))
                off += len(v)
            return self.put_batch_from(keys, sources, sizes, **opts)

    def put_batch_from(
        self,
        keys: Sequence[str],
        sources: Sequence[tuple[str, int]],
        sizes: Sequence[int],
        **opts: Any,
    ) -> list[KeyResult]:
        """Zero-copy put_batch: keys[i]'s value is sizes[i] bytes at sources[i] = (registered
        segment, offset in it); one KeyResult per key (status ok or why not)."""
        if not len(keys) == len(sources) == len(sizes):
            raise StoreError(
                f"put_batch_from: {len(keys)} keys, {len(sources)} sources, {len(sizes)} sizes"
            )
        keys = [self._key(k) for k in keys]
        if not keys:
            return []
        self._forget_locations(keys)
        sizes = tuple(sizes)
        for k, size in zip(keys, sizes, strict=True):
            self._check_size(k, size)
        shape = None  # every value the same size: write slots apply
        if self.slots is not None and len(set(sizes)) == 1:
            shape = PutShape.of(sizes[0], opts)
            taken = self.slots.take_many(shape, len(keys), time.monotonic())
            if taken:
                entries: list[SlotEntry] = [
                    (key, t, seg, off)
                    for key, t, (seg, off) in zip(keys, taken, sources, strict=True)
                ]
                return self._put_into_slots(shape, entries, opts)
        reserve = self.slots.want(sizes[0], len(keys)) if self.slots and shape else 0
        msg = m.BatchPutStartMsg(tuple(keys), sizes, self.node_id, **opts, reserve=reserve)
        sent_at = time.monotonic()
        reply = self._call(msg, m.BatchPutStartReplyMsg)
        if self.slots is not None and shape is not None and reply.slots:
            self.slots.add(shape, reply.slots, sent_at)
        starts = self._wait_for_room(reply.results, sizes, opts)
        unmoved = self.relocator.copy(starts)
        plan: WritePlan = [
            (r.key, r.replicas, seg, off)
            for r, (seg, off) in zip(starts, sources, strict=True)
            if r.status == "ok" and r.key not in unmoved
        ]
        failed = {**unmoved, **self.data.write(plan)}
        if failed:
            self._revoke(list(failed))
        ok = tuple(r.key for r in starts if r.status == "ok" and r.key not in failed)
        ends = {r.key: r for r in self._call(m.BatchPutEndMsg(ok), m.BatchKeyReplyMsg).results}
        out = []
        for r in starts:
            if r.key in failed:
                out.append(KeyResult(key=r.key, status="error", message=failed[r.key]))
                continue
            end = ends.get(r.key)
            if end is not None and end.status == "ok":
                self._learn(r.key, r.replicas)
            out.append(end or KeyResult(key=r.key, status=r.status, message=r.message))
        return out

    def _put_into_slots(
        self, shape: PutShape, entries: list[SlotEntry], opts: dict[str, Any]
    ) -> list[KeyResult]:
        """Write each (key, taken slot, local segment, offset) into its slot, commit those
        written in one call (which refills the pool), keep the slots of refused keys; one
        KeyResult per entry."""
        assert self.slots is not None
        failed = self.data.write([(k, t[0].replicas, seg, off) for k, t, seg, off in entries])
        if failed:
            bad = tuple(t[0].slot_id for k, t, _, _ in entries if k in failed)
            with contextlib.suppress(StoreError):
                self._call(m.ReleaseSlotsMsg(bad, self.node_id), m.AckMsg)
        todo = [(k, t) for k, t, _, _ in entries if k not in failed]
        answers: Iterator[KeyResult] = iter(())
        if todo:
            sent_at = time.monotonic()
            msg = m.BatchPutSlotMsg(
                tuple(k for k, _ in todo),
                tuple(t[0].slot_id for _, t in todo),
                self.node_id,
                opts.get("pin_ttl_s", 0.0),
                opts.get("overwrite", False),
                self.slots.refill(shape, len(entries)),
            )
            reply = self._call(msg, m.BatchPutSlotReplyMsg)
            if reply.slots:
                self.slots.add(shape, reply.slots, sent_at)
            answers = iter(reply.results)  # NOTE: one per entry not failed, in order
        out = []
        for key, taken, _, _ in entries:
            if key in failed:  # NOTE: todo left out every key in failed
                why = f"put of {key!r} failed, nothing was committed: {failed[key]}"
                out.append(KeyResult(key=key, status="error", message=why))
                continue
            r = next(answers)
            if r.status in ("exists", "busy", "leased"):  # the slot is still ours
                self.slots.give_back(shape, taken)
            elif r.status == "ok":
                self._learn(key, taken[0].replicas)
            out.append(r)
        return out

    def get_batch(self, keys: Sequence[str]) -> list[ValueResult]:
        """Get every key; one ValueResult per key, in order. One lookup for the keys not
        read within their lease, then every value in one overlapping batch of reads."""
        wanted = list(dict.fromkeys(self._key(k) for k in keys))
        located = self._find(wanted)
        sizes = {k: w[1] for k, w in located.found.items() if not isinstance(w, ValueResult)}
        out: dict[str, ValueResult] = {}
        with self._lock:
            self._stage(sum(sizes.values()))
            dests, offsets, off = [], {}, 0
            for key in wanted:
                offsets[key] = off
                dests.append((self._staging_name, off, 0))
                off += sizes.get(key, 0)
            for key, r in zip(wanted, self._read_found(wanted, dests, located), strict=True):
                if r.status == "ok":
                    at = offsets[key]
                    r = msgspec.structs.replace(r, value=self._staging[at : at + r.size].tobytes())
                out[key] = r
        return [out[k] for k in map(self._key, keys)]

    def get_batch_into(
        self, keys: Sequence[str], dests: Sequence[tuple[str, int, int]]
    ) -> list[ValueResult]:
        """Zero-copy get_batch: keys[i]'s value into dests[i] = (registered segment, offset,
        bytes there: a larger value is refused; 0 = no limit). One ValueResult per key, in
        order: status ok with `size` (no `value`: the bytes are in place), or why not."""
        if len(keys) != len(dests):
            raise StoreError(f"get_batch_into: {len(keys)} keys but {len(dests)} buffers")
        keys = [self._key(k) for k in keys]
        return self._read_found(keys, dests, self._find(list(dict.fromkeys(keys))))

    def _find(self, keys: Sequence[str]) -> _Located:
        """Where each of `keys` (distinct) is: from the reads still in lease, then one
        lookup for the rest."""
        found: dict[str, tuple[list[ReplicaDesc], int] | ValueResult] = {}
        now, cache = time.monotonic(), self.locations
        for key in keys:
            if cache is not None and (hit := cache.get(key, now)):
                found[key] = [hit[0]], hit[1]
        cold = tuple(k for k in keys if k not in found)
        sent_at, ttl = time.monotonic(), 0.0
        for r in self.locate_batch(cold):
            if r.replicas:
                found[r.key], ttl = (list(r.replicas), r.size), r.lease_ttl_s
            else:
                found[r.key] = _miss(r)
        return _Located(found, set(cold), sent_at, ttl)

    def _read_found(
        self, keys: Sequence[str], dests: Sequence[tuple[str, int, int]], located: _Located
    ) -> list[ValueResult]:
        """Read keys[i] (located by `_find`) into dests[i] = (segment, offset, limit) in one
        batch; a value read from a stale location is asked of the master again."""
        found, cold, sent_at, ttl = located.found, located.cold, located.sent_at, located.ttl
        out: list[ValueResult | None] = [None] * len(keys)
        plan: ReadPlan = []
        where: list[int] = []  # the index in keys of each plan entry
        for i, (key, (seg, off, limit)) in enumerate(zip(keys, dests, strict=True)):
            if isinstance(where_ := found[key], ValueResult):
                out[i] = where_
            elif limit and where_[1] > limit:
                why = f"{key!r} is {where_[1]} bytes; the buffer offers {limit}"
                out[i] = ValueResult(key=key, status="too_large", message=why)
            else:
                plan.append((key, where_[0], seg, off, where_[1]))
                where.append(i)
        failed, moved = self.data.read_many(plan)
        cache = self.locations
        for i, (key, tried, seg, off, size) in zip(where, plan, strict=True):
            if key in failed and key not in cold:  # a stale location: ask the master
                self._forget_locations([key])
                try:  # NOTE: a value grown since does not fit its place: an error
                    size = self._get(key, seg, off, dests[i][2] or size)
                except StoreError as e:
                    out[i] = ValueResult(key=key, status=_status(e), message=str(e))
                    continue
            elif key in failed:
                out[i] = ValueResult(key=key, status="error", message=failed[key])
                continue
            out[i] = ValueResult(key=key, status="ok", size=size)
            if cache is not None and (key in cold or key in moved):
                cache.put(key, moved.get(key, tried[0]), size, sent_at, ttl)
        assert all(r is not None for r in out), out
        return out  # type: ignore[return-value]

    def locate_batch(self, keys: Sequence[str]) -> list[GetResult]:
        """Where each key's committed value is: one GetResult per key, in order, its
        replicas ranked cheapest first (none readable: an empty list). An "ok" one grants a
        read lease: read the replicas within `lease_ttl_s` of asking (the caller moves the
        bytes itself, e.g. a layer at a time straight into its own registered memory)."""
        out: list[GetResult] = []
        keys = [self._key(k) for k in keys]
        for start in range(0, len(keys), m.MAX_BATCH):
            msg = m.BatchGetReplicasMsg(tuple(keys[start : start + m.MAX_BATCH]), self.node_id)
            for r in self._call(msg, m.BatchGetReplicasReplyMsg).results:
                ranked = self.data.rank(r.replicas) if r.status == "ok" else []
                out.append(msgspec.structs.replace(r, replicas=tuple(ranked)))
        return out

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a committed object (any number of keys, asked in chunks)."""
        out = []
        for start in range(0, len(keys), m.MAX_BATCH):
            msg = m.BatchExistsMsg(tuple(map(self._key, keys[start : start + m.MAX_BATCH])))
            out += [r.status == "ok" for r in self._call(msg, m.BatchKeyReplyMsg).results]
        return out

    def remove_batch(
        self, keys: Sequence[str], *, force: bool = False, wait: bool = True
    ) -> list[KeyResult]:
        """Remove every key, waiting up to timeout_s for leases (`wait` False: ask once;
        `force`: remove leased ones too); one KeyResult per key."""
        out = {k: KeyResult(key=k, status="leased") for k in map(self._key, keys)}
        self._forget_locations(out)
        deadline = time.monotonic() + self.timeout_s
        while pending := tuple(k for k, r in out.items() if r.status == "leased"):
            for start in range(0, len(pending), m.MAX_BATCH):  # the master's limit per call
                msg = m.BatchRemoveMsg(pending[start : start + m.MAX_BATCH], force)
                for r in self._call(msg, m.BatchKeyReplyMsg).results:
                    out[r.key] = r
            if not wait or time.monotonic() > deadline:
                break
            if all(r.status != "leased" for r in out.values()):
                break
            time.sleep(0.02)
        return [out[k] for k in keys]

    # -- values written in place by several writers ------------------------------------------

    def start_puts(self, keys: Sequence[str], size: int, **opts: Any) -> list[PutStartResult]:
        """Allocate `keys`, `size` bytes each, and write nothing: each "ok" result carries
        the replicas that the caller, and whoever it hands them to, write with their own
        Transfer Engine (the value's parts in place: a pipeline stage's layers of a KV
        object). Readers never see a key before `end_puts`; `revoke_puts` drops them, and
        the master reclaims a put left unfinished past its put timeout."""
        keys = [self._key(k) for k in keys]
        for k in keys:
            self._check_size(k, size)
        self._forget_locations(keys)
        out: list[PutStartResult] = []
        for i in range(0, len(keys), m.MAX_BATCH):  # the master's limit per call
            part = tuple(keys[i : i + m.MAX_BATCH])
            msg = m.BatchPutStartMsg(part, (size,) * len(part), self.node_id, **opts)
            results = self._call(msg, m.BatchPutStartReplyMsg).results
            out += self._wait_for_room(results, [size] * len(part), opts)
        if failed := self.relocator.copy(out):
            self._revoke(list(failed))
            out = [
                PutStartResult(key=r.key, status="error", message=failed[r.key])
                if r.key in failed
                else r
                for r in out
            ]
        return out

    def _wait_for_room(
        self, starts: Sequence[PutStartResult], sizes: Sequence[int], opts: dict[str, Any]
    ) -> list[PutStartResult]:
        """`starts` (put_start answers for values of `sizes`), each that found no room
        while the master said room is on its way (`room_pending`: demotions to SSD in
        flight) asked again every put_retry_s until it gets an answer or put_wait_s ran
        out (then its last answer stands)."""
        out = list(starts)
        deadline = time.monotonic() + self.put_wait_s
        while waiting := [
            i for i, r in enumerate(out) if r.status == "no_space" and r.room_pending
        ]:
            if time.monotonic() + self.put_retry_s > deadline:
                break
            time.sleep(self.put_retry_s)
            keys = tuple(out[i].key for i in waiting)
            msg = m.BatchPutStartMsg(keys, tuple(sizes[i] for i in waiting), self.node_id, **opts)
            for i, r in zip(waiting, self._call(msg, m.BatchPutStartReplyMsg).results, strict=True):
                out[i] = r
        return out

    def end_puts(
        self, keys: Sequence[str], replicas: Sequence[Sequence[ReplicaDesc]] = ()
    ) -> list[KeyResult]:
        """Commit keys started with `start_puts` once every part is written (`replicas`:
        where each was written, remembered as hints for this client's next gets)."""
        out: list[KeyResult] = []
        for i in range(0, len(keys), m.MAX_BATCH):
            part = tuple(keys[i : i + m.MAX_BATCH])
            out += self._call(m.BatchPutEndMsg(part), m.BatchKeyReplyMsg).results
        for key, r, reps in zip(keys, out, replicas, strict=False):
            if r.status == "ok":
                self._learn(key, reps)
        return out

    def revoke_puts(self, keys: Sequence[str]) -> None:
        """Drop keys started with `start_puts` and not committed (best effort)."""
        for i in range(0, len(keys), m.MAX_BATCH):
            self._revoke(list(keys[i : i + m.MAX_BATCH]))

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _still_there(guess: tuple[ReplicaDesc, Finish], r: GetResult) -> ReplicaDesc | None:
        """The replica a hinted read went to, if `r` (the master's answer) still lists that
        very allocation: replica ids are never reused, and a committed replica's bytes
        never change while it exists, so it held the value from when the hint was learned
        until the master answered. _in_lease() must also hold once the read is done."""
        was = guess[0]
        for d in r.replicas:
            if was.replica_id and d.replica_id == was.replica_id and d.segment == was.segment:
                return d if d.size == r.size else None
        return None

    @staticmethod
    def _in_lease(r: GetResult, sent_at: float) -> bool:
        """The read that just ended ended within the lease `r` granted (counted from
        before the ask): so it cannot have read after the range was reused either."""
        return time.monotonic() - sent_at < r.lease_ttl_s * MARGIN

    def _get_replicas(self, key: str) -> GetResult:
        """The replicas of `key` (SSD ones too: they are read where they are)."""
        return self._checked(
            self._call(m.GetReplicasMsg(self._key(key), self.node_id), m.GetReplicasReplyMsg).result
        )

    def _checked(self, r: GetResult) -> GetResult:
        if r.status == "not_found":
            raise NotFoundError(f"{r.key!r} is not in the store")
        if r.status != "ok":
            raise StatusError(r.message or f"get of {r.key!r}: {r.status}", r.status)
        return r

    def _call(self, msg: Msg, reply_type: type[Any]) -> Any:
        try:
            return self._calls.call(msg, reply_type)
        except StoreError:
            raise
        except MooncakeError as e:
            raise StoreError(f"store master {self.master.address}: {e}") from e

    def _forget_locations(self, keys: Iterable[str]) -> None:
        if self.locations is not None:
            for key in keys:
                self.locations.drop(key)

    def _learn(self, key: str, replicas: Sequence[ReplicaDesc]) -> None:
        """Remember where this client just wrote `key` (the replica it would read first),
        as a hint for its next get (store/client/grants.py)."""
        if self.locations is not None and (ranked := self.data.rank(replicas)):
            self.locations.learn(key, ranked[0], ranked[0].size)

    def _stage(self, size: int) -> None:
        if size > len(self._staging):
            self.engine.unregister(self._staging_name)
            self._staging = self.engine.allocate(self._staging_name, 1 << (size - 1).bit_length())

    def _revoke(self, keys: list[str]) -> None:
        # NOTE: if this fails the master reclaims the unfinished put after put_timeout_s
        with contextlib.suppress(StoreError):
            self._call(m.BatchPutRevokeMsg(tuple(keys)), m.BatchKeyReplyMsg)

    @staticmethod
    def _key(key: str) -> str:
        if why := key_error(key):
            raise StatusError(why, "error")
        return key

    @staticmethod
    def _check_size(key: str, size: int) -> None:
        if not 0 < size <= m.MAX_VALUE_BYTES:
            why = (
                f"value of {key!r} is {size} bytes; it must be 1 byte to {m.MAX_VALUE_BYTES} bytes"
            )
            raise StatusError(why, "error")

    @staticmethod
    def _raise(r: PutStartResult | KeyResult) -> None:
        if r.status == "ok":
            return
        if r.status == "not_found":
            raise NotFoundError(r.message or f"{r.key!r} is not in the store")
        raise StatusError(r.message or f"{r.key!r}: {r.status}", r.status)


def _miss(r: GetResult) -> ValueResult:
    """The ValueResult of a lookup that found no readable replica."""
    if r.status == "not_found":
        return ValueResult(key=r.key, status="not_found", message=f"{r.key!r} is not in the store")
    if r.status == "ok":  # NOTE: a committed object always has a replica; not on the wire
        why = f"{r.key!r}: the master listed no replica to read; retry"
        return ValueResult(key=r.key, status="error", message=why)
    return ValueResult(key=r.key, status="error", message=r.message or f"{r.key!r}: {r.status}")


def _status(e: StoreError) -> str:
    return "not_found" if isinstance(e, NotFoundError) else "error"
