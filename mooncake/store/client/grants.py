"""What a Store client may reuse of the master's answers without asking again.

- `LocationCache`: a get leases its object for `lease_ttl_s` (the master neither evicts,
  removes nor overwrites it until then), so for that long the replica the client read is
  where the value still is: a repeated get reads it again with one round trip, to the
  node, instead of two. The lease ends a margin before the master's, counted from when
  the client *sent* its request (the master's lease started later). After that the entry
  stays as a hint (`guess`), as do the replicas of the client's own puts: where the value
  was. A get then reads there while it asks the master, and keeps what it read only if
  the master's answer still lists that very replica (its `replica_id`: store/client/client.py).
- `SlotPool`: write slots (store/metadata/slots.py) by put shape, each usable until its grant runs
  out, counted the same way.

Both are per client and thread-safe; neither talks to anyone.

    cache.put(key, replica, size, sent_at, lease_ttl_s)
    hit = cache.get(key, time.monotonic())         # (replica, size) within the lease, or None
    cache.learn(key, replica, size)                # a hint only (a put's replica)
    hint = cache.guess(key)                        # (replica, size) of the last known place
    pool.add(shape, slots, sent_at); slot, until = pool.take(shape, time.monotonic())
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

from mooncake.store.metadata.objects import ReplicaDesc, Slot

MARGIN = 0.8  # share of a grant's length the client relies on (clock rates, scheduling)


class PutShape(NamedTuple):
    """The put options a write slot stands for."""

    size: int  # bytes
    replicas: int  # 0 = the master's default
    tiers: tuple[str, ...]

    @classmethod
    def of(cls, size: int, opts: Mapping[str, Any]) -> PutShape:
        """The shape of a put of `size` bytes with the client's put options `opts`."""
        return cls(size, opts.get("replicas", 0), tuple(opts.get("tiers", ("dram",))))


class LocationCache:
    """key -> (replica, size, lease end) of recent reads and puts, least recently used
    first; a lease end of 0 is a hint only."""

    def __init__(self, max_entries: int = 1 << 16):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[ReplicaDesc, int, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0  # gets served without asking the master
        self.num_overlapped = 0  # gets that read a hint while asking the master, and kept it

    def get(self, key: str, now: float) -> tuple[ReplicaDesc, int] | None:
        """The replica and size of `key` if its lease still covers `now`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[2] <= now:
                return None
            self._entries.move_to_end(key)
            self.num_hits += 1
            return entry[0], entry[1]

    def guess(self, key: str) -> tuple[ReplicaDesc, int] | None:
        """Where `key` was last known to be, leased or not (it may have moved since)."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else (entry[0], entry[1])

    def put(self, key: str, replica: ReplicaDesc, size: int, sent_at: float, ttl_s: float) -> None:
        """Remember where `key` was read; its lease of `ttl_s` began after `sent_at`."""
        self._add(key, (replica, size, sent_at + ttl_s * MARGIN if ttl_s > 0 else 0.0))

    def learn(self, key: str, replica: ReplicaDesc, size: int) -> None:
        """Remember where `key` was just written: a hint, with no lease."""
        self._add(key, (replica, size, 0.0))

    def _add(self, key: str, entry: tuple[ReplicaDesc, int, float]) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def drop(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)


class SlotPool:
    """Write slots by put shape, each with the time until which it may be written."""

    def __init__(self, max_bytes: int = 32 << 20, max_slots: int = 4, max_batch: int = 64):
        # held per shape, at most: max_slots for single puts, up to max_batch for batches,
        # never more than max_bytes
        self.max_bytes, self.max_slots, self.max_batch = max_bytes, max_slots, max_batch
        self._slots: dict[PutShape, list[tuple[Slot, float]]] = {}
        self._expired: list[int] = []  # slot ids to give back
        self._lock = threading.Lock()

    def want(self, size: int, count: int = 1) -> int:
        """How many slots of `size` bytes to ask for, for puts of `count` values at once."""
        held_for = max(self.max_slots, min(2 * count, self.max_batch))
        return max(0, min(held_for, self.max_bytes // size))

    def add(self, shape: PutShape, slots: tuple[Slot, ...], sent_at: float) -> None:
        with self._lock:
            held = self._slots.setdefault(shape, [])
            held += [(s, sent_at + s.ttl_s * MARGIN) for s in slots]

    def take(self, shape: PutShape, now: float) -> tuple[Slot, float] | None:
        """A slot for a put of this shape that may still be written, with the time until
        which it may, or None. Expired ones are kept for drain() (the master would also
        reclaim them after put_timeout_s)."""
        with self._lock:
            held = self._slots.get(shape)
            while held:
                slot, until = held.pop()
                if until > now:
                    return slot, until
                self._expired.append(slot.slot_id)
            return None

    def refill(self, shape: PutShape, count: int = 1) -> int:
        """How many slots to ask for with a commit of this shape, for puts of `count`
        values at once: a batch once fewer than `count` are left, none before
        (allocations come a few at a time)."""
        with self._lock:
            held = len(self._slots.get(shape, ()))
        return 0 if held >= count else max(0, self.want(shape.size, count) - held)

    def take_many(self, shape: PutShape, count: int, now: float) -> list[tuple[Slot, float]]:
        """`count` slots for puts of this shape, or none at all (too few still usable)."""
        taken: list[tuple[Slot, float]] = []
        for _ in range(count):
            got = self.take(shape, now)
            if got is None:
                for t in taken:
                    self.give_back(shape, t)
                return []
            taken.append(got)
        return taken

    def give_back(self, shape: PutShape, taken: tuple[Slot, float]) -> None:
        """Return a slot taken with take() and not used (its commit was refused)."""
        with self._lock:
            self._slots.setdefault(shape, []).append(taken)

    def held(self) -> list[Slot]:
        """Every slot held now (expired or not), for inspection."""
        with self._lock:
            return [s for held in self._slots.values() for s, _ in held]

    def drain(self) -> list[int]:
        """Every slot id held or expired (the pool is empty afterwards): to release."""
        with self._lock:
            ids = self._expired + [s.slot_id for held in self._slots.values() for s, _ in held]
            self._slots.clear()
            self._expired = []
            return ids
