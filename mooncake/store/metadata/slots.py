"""Write slots: space the master reserves for a writer's next puts of the same size.

A put is three round trips (put_start allocates, the client writes the bytes to the
replicas, put_end commits), and with fixed-size values (KV blocks) the first one is always
the same question. So a put_start may also reserve up to `reserve` slots: allocations of
the same size, replica count and tiers, held for that writer as uncommitted objects under
an internal key. The writer's next put of that shape writes straight into a slot and
commits it under its real key (`commit`): two round trips. A commit may ask for `refill`
new slots like it (the writer's last one used: a batch of allocations every few puts,
not one per put), so a steady stream of puts stays at two.

    put_start(k1, reserve=4) -> replicas of k1 + 4 slots             (3 round trips, once)
    write k2 into slot 7; commit(k2, slot=7) -> ok                   (2 round trips)
    write k5 into slot 9; commit(k5, slot=9, refill=4) -> ok + 4 slots

A slot is an ordinary PROCESSING object: eviction skips it, a node's death takes its
replicas, and an unused one is reclaimed after put_timeout_s like any unfinished put.
Slots are only carved out of spare space of the put's first tier: never where the tier
would pass its high watermark, so holding space ahead never evicts anything (and a put
that may fall back to SSD never holds SSD space ahead).
Writers use a slot only within `grant_ttl_s` of asking for it (the master may restart and
lose its books; a remounted segment takes no new objects for that long, see
`MetadataService.mount_segment`), so a write never lands in space the master gave away.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

from mooncake.store.metadata.objects import COMPLETE, KeyResult, ObjectRecord, Slot
from mooncake.store.metadata.settings import key_error

if TYPE_CHECKING:
    from mooncake.store.metadata.pool import Pool
    from mooncake.store.metadata.settings import MetadataConfig
    from mooncake.store.metadata.writes import WriteProtocol

SLOT_KEY_PREFIX: Final = "\x00slot:"  # user keys cannot start with NUL (key_error)
MAX_RESERVE: Final = 64  # slots per request (a batch of puts takes one each)
MAX_RESERVE_BYTES: Final = 64 << 20  # bytes of slots per request


class SlotSpec(NamedTuple):
    """What a slot was reserved for: its writer and the put options it stands in for."""

    writer: str
    replicas: int  # 0 = the master's default
    tiers: tuple[str, ...]


class SlotBook:
    """The slots held by writers: slot id -> what it was reserved for. The objects
    themselves live in the pool under `slot_key(id)`; `writes` allocates and commits."""

    def __init__(self, pool: Pool, writes: WriteProtocol, config: MetadataConfig):
        self.pool = pool
        self.writes = writes
        self.config = config
        self.specs: dict[int, SlotSpec] = {}
        self._ids = itertools.count(1)

    @property
    def grant_ttl_s(self) -> float:
        """Seconds after asking during which a writer may use a slot."""
        return self.config.lease_ttl_s

    def reserve(self, size: int, count: int, spec: SlotSpec, now: float) -> list[Slot]:
        """Up to `count` new slots of `size` bytes (fewer when spare space runs out, never
        more than MAX_RESERVE or MAX_RESERVE_BYTES in all)."""
        pool, out = self.pool, []
        count = min(count, MAX_RESERVE, MAX_RESERVE_BYTES // size)
        for _ in range(count):
            slot_id = next(self._ids)
            key = slot_key(slot_id)
            chosen = self.writes.allocate_replicas(
                key, size, spec.writer, spec.replicas, spec.tiers, now, spare_only=True
            )
            if not chosen:
                break
            obj = ObjectRecord(key, size, spec.writer, now, chosen)
            obj.wanted = spec.replicas or self.config.replicas
            pool.start_writing(obj)
            self.specs[slot_id] = spec
            out.append(self._desc(slot_id, obj))
        return out

    def commit(
        self,
        key: str,
        slot_id: int,
        writer: str,
        now: float,
        pin_ttl_s: float = 0.0,
        overwrite: bool = False,
        refill: int = 0,
    ) -> tuple[KeyResult, tuple[Slot, ...]]:
        """Commit the bytes written into slot `slot_id` as `key` (readable from now on),
        and reserve up to `refill` more slots like it. A refusal for the key (exists,
        busy, leased) leaves the slot reserved for the writer's next put; an unknown slot
        (reclaimed, or already used) is an error: put again without it."""
        spec = self.specs.get(slot_id)
        obj = self.pool.objects.get(slot_key(slot_id))
        if spec is None or obj is None or spec.writer != writer:
            msg = (
                f"write slot {slot_id} is not held by {writer!r}: it was reclaimed after "
                "put_timeout_s, already committed, or never reserved; put the key again"
            )
            return KeyResult(key=key, status="error", message=msg), ()
        if err := key_error(key):
            return KeyResult(key=key, status="error", message=err), ()
        refusal = self.writes.clear_for_put(key, overwrite, now)
        if refusal:
            return refusal, ()
        self._rekey(obj, key, pin_ttl_s)
        del self.specs[slot_id]
        result = self.writes.put_end(key, now)
        return result, tuple(self.reserve(obj.size, refill, spec, now)) if refill else ()

    def commit_many(
        self,
        keys: Sequence[str],
        slot_ids: Sequence[int],
        writer: str,
        now: float,
        pin_ttl_s: float = 0.0,
        overwrite: bool = False,
        refill: int = 0,
    ) -> tuple[list[KeyResult], tuple[Slot, ...]]:
        """commit() of each key into its slot (a batch of puts), then up to `refill` new
        slots like the first one committed."""
        if len(keys) != len(slot_ids):
            msg = f"{len(keys)} keys but {len(slot_ids)} write slots; send one slot per key"
            return [KeyResult(key=k, status="error", message=msg) for k in keys], ()
        objects = self.pool.objects
        like = next(
            (
                (self.specs[i], objects[slot_key(i)].size)
                for i in slot_ids
                if i in self.specs and slot_key(i) in objects
            ),
            None,
        )
        results = [
            self.commit(k, i, writer, now, pin_ttl_s, overwrite)[0]
            for k, i in zip(keys, slot_ids, strict=True)
        ]
        if not refill or like is None or like[0].writer != writer:
            return results, ()
        return results, tuple(self.reserve(like[1], refill, like[0], now))

    def release(self, slot_ids: Sequence[int], writer: str, now: float) -> int:
        """Give back the writer's unused slots; returns how many were freed."""
        freed = 0
        for slot_id in slot_ids:
            spec = self.specs.get(slot_id)
            obj = self.pool.objects.get(slot_key(slot_id))
            if spec is not None and spec.writer == writer and obj is not None:
                self.pool.drop(obj, now, emit=None)  # NOTE: the pool's on_drop calls forget()
                freed += 1
        return freed

    def forget(self, key: str) -> None:
        """The object `key` was dropped: if it was a slot, forget the slot too."""
        if key.startswith(SLOT_KEY_PREFIX):
            self.specs.pop(int(key[len(SLOT_KEY_PREFIX) :]), None)

    def check_integrity(self) -> None:
        for slot_id in self.specs:
            obj = self.pool.objects.get(slot_key(slot_id))
            assert obj is not None and not obj.is_committed, f"slot {slot_id}: {obj}"

    # -- helpers ---------------------------------------------------------------------------

    def _rekey(self, obj: ObjectRecord, key: str, pin_ttl_s: float) -> None:
        pool, old = self.pool, obj.key
        del pool.objects[old]
        del pool.writing[old]
        for r in obj.replicas:
            assert r.state != COMPLETE, (old, r)
            r.segment.keys.discard(old)
            r.segment.keys.add(key)
        obj.key, obj.pin_ttl_s = key, max(pin_ttl_s, 0.0)
        pool.objects[key] = obj
        pool.writing[key] = None  # NOTE: out of started_at order, but committed in this call

    def _desc(self, slot_id: int, obj: ObjectRecord) -> Slot:
        replicas = tuple(r.desc() for r in obj.replicas)
        return Slot(slot_id=slot_id, replicas=replicas, ttl_s=self.grant_ttl_s)


def slot_key(slot_id: int) -> str:
    return f"{SLOT_KEY_PREFIX}{slot_id}"
