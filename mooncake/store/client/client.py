"""The Store's client API, for our prefill/decode nodes and for other engines.

    store = Store.connect("tcp://10.0.0.1:7100", secret)
    store.put("block-1", kv_bytes, replicas=2)
    data = store.get("block-1")                  # bytes, or NotFoundError / StoreError
    buf = store.register_buffer("kv", array)     # zero-copy: the engine moves bytes in place
    store.put_from("block-2", "kv", offset, size); store.get_into("block-2", "kv", offset)
    results = store.put_batch(keys, values)      # per-key KeyResult / ValueResult
    store.close()

Metadata goes to the master (put_start / put_end / get_replicas), on its direct channel
when it offers one (store/direct.py: no ZeroMQ thread hops), else over the RPC; bytes go
through this client's Transfer Engine straight to or from the node owning each replica
(store/datapath.py), never through the master. Round trips per call, once warm:

    put, put_from   2: write into a write slot (store/slots.py), commit it
    get, get_into   1 while the last read's lease lasts (store/grants.py), else 2
    put_batch       2 when every value has the same size (a slot each, one commit)
    get_batch       1 lookup for the keys not read within their lease, then all reads at once

Every failure raises StoreError with what happened and what to do; a miss raises
NotFoundError. The batch calls live in store/batches.py (`BatchCalls`, this class's base).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from mooncake.errors import MooncakeError, StoreError, TransferError
from mooncake.rpc.client import RpcClient
from mooncake.rpc.wire import Msg
from mooncake.store.client.batches import BatchCalls, NotFoundError, ValueResult
from mooncake.store.client.datapath import DataPath
from mooncake.store.client.grants import MARGIN, LocationCache, PutShape, SlotPool
from mooncake.store.client.relocator import Relocator
from mooncake.store.metadata.objects import GetResult, ReplicaDesc
from mooncake.store.server import messages as m
from mooncake.store.server.direct import MasterCalls
from mooncake.transfer.engine import TransferEngine
from mooncake.transfer.inline import Finish
from mooncake.transfer.staging import BaseStaging, Event
from mooncake.transfer.types import EngineOptions

__all__ = ["NotFoundError", "Store", "ValueResult"]


class Store(BatchCalls):
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
        (store/direct.py); False keeps every call on the CURVE-encrypted RPC.
        `reuse_grants`: reuse read leases and write slots (store/grants.py); False asks
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
        reuse_grants: bool = True,  # reuse read leases and write slots (store/grants.py)
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
            raise StoreError(f"{key!r} is {r.size} bytes; the buffer offers {max_size}")
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

    def remove(self, key: str) -> None:
        """Remove `key`, waiting up to timeout_s for readers' leases to end; NotFoundError
        if absent, StoreError if still leased (or busy) by then; a pin does not block it."""
        self._forget_locations([key])
        deadline = time.monotonic() + self.timeout_s
        while True:
            r = self._call(m.RemoveMsg(self._key(key)), m.KeyReplyMsg).result
            if r.status != "leased" or time.monotonic() > deadline:
                return self._raise(r)
            time.sleep(0.02)

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
            raise StoreError(r.message or f"get of {r.key!r}: {r.status}")
        return r

    def _call(self, msg: Msg, reply_type: type[Any]) -> Any:
        try:
            return self._calls.call(msg, reply_type)
        except StoreError:
            raise
        except MooncakeError as e:
            raise StoreError(f"store master {self.master.address}: {e}") from e
