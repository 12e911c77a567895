"""LRU building blocks of the simulator: a node's tier of blocks in recency order
(`LruTier`), and the paper's Table 1 measure (`global_lru_hit_rate`): one global LRU pool
of `capacity` blocks, requests replayed in order, hit = the longest prefix of a request's
blocks that is resident, hit rate = hits / blocks requested.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mooncake.sim.trace import TraceRecord


class LruTier:
    """A node's blocks of one tier in its own recency order; `capacity` None is unbounded."""

    __slots__ = ("blocks", "capacity", "name")

    def __init__(self, name: str, capacity: int | None):
        self.name = name
        self.capacity = capacity  # blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    @property
    def has_room(self) -> bool:
        return self.capacity is None or len(self.blocks) < self.capacity

    @property
    def room(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - len(self.blocks)

    def put(self, h: int) -> list[int]:
        """Insert or refresh `h` as most recent; returns the blocks evicted, oldest first."""
        blocks = self.blocks
        if h in blocks:
            blocks.move_to_end(h)
            return []
        blocks[h] = None
        evicted = []
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def remove(self, h: int) -> None:
        self.blocks.pop(h, None)


def global_lru_hit_rate(records: Sequence[TraceRecord], capacity: int | None) -> float:
    """Table 1's hit rate of one global LRU pool of `capacity` blocks (None = unbounded)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for rec in records:
        ids = rec.hash_ids
        for h in ids:
            if h not in lru:
                break
            hits += 1
        total += len(ids)
        for h in ids:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        if capacity is not None:
            while len(lru) > capacity:
                lru.popitem(last=False)
    return hits / total if total else 0.0
