"""The simulated KV pool: per-node tiers with LRU eviction, reporting to the prefix index.

Each pool node holds blocks in a DRAM tier and optionally an SSD tier, both LRU. A block
evicted from DRAM is demoted to SSD when there is one, else dropped; a block evicted from
SSD is dropped; a block read from SSD moves back to DRAM. Every change reaches the
Conductor's `PrefixIndex` as added / demoted / evicted, as the real Store's events would,
and, with a `MissLedger`, every use and every drop reaches the ledger too (times in
seconds of simulated time), so a request's misses can be explained (`conductor/misses.py`).

`global_lru_hit_rate` is the paper's Table 1 measure: one global LRU pool of `capacity`
blocks, requests replayed in order, hit = the longest prefix of a request's blocks that
is resident, hit rate = hits / blocks requested.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from mooncake.conductor.index import PrefixIndex
from mooncake.conductor.misses import MissLedger
from mooncake.sim.trace import TraceRecord


class LruTier:
    """Blocks in least-recently-used order; `capacity` None is unbounded."""

    __slots__ = ("blocks", "capacity", "name")

    def __init__(self, name: str, capacity: int | None):
        self.name = name
        self.capacity = capacity  # blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

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


class NodePool:
    """One node's share of the pool (DRAM tier, optional SSD tier)."""

    def __init__(
        self,
        node: str,
        dram_blocks: int | None,
        ssd_blocks: int = 0,
        index: PrefixIndex | None = None,
        top_tier: str = "dram",
        ledger: MissLedger | None = None,
    ):
        self.node = node
        self.top = LruTier(top_tier, dram_blocks)
        self.ssd = LruTier("ssd", ssd_blocks) if ssd_blocks else None
        self.index = index
        self.ledger = ledger
        self.num_evicted = 0  # blocks dropped from the node

    def prefix_len(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the node holds in any tier."""
        top, ssd, n = self.top.blocks, self.ssd.blocks if self.ssd else {}, 0
        for h in hashes:
            if h in top or h in ssd:
                n += 1
            else:
                break
        return n

    def touch(self, hashes: Iterable[int], t: float) -> None:
        """Blocks were read here at `t`: refresh those the node holds (a prefix split
        across nodes is read from each holder, so some of `hashes` may be elsewhere)."""
        top, ssd = self.top.blocks, self.ssd.blocks if self.ssd else {}
        self.store([h for h in hashes if h in top or h in ssd], t)

    def store(self, hashes: Sequence[int], t: float) -> None:
        """Blocks were written or read here at `t`: make them the most recent in the top
        tier."""
        if self.ledger is not None:
            self.ledger.used(hashes, t)
        top, ssd = self.top.blocks, self.ssd
        changed: dict[int, None] = {}  # blocks whose tier changed, reported at the end
        for h in hashes:
            if h in top:
                top.move_to_end(h)
                continue
            if ssd is not None and h in ssd.blocks:
                ssd.remove(h)
            top[h] = None
            changed[h] = None
        # NOTE: evicting once at the end drops the same blocks, in the same order, as
        # evicting after each insertion: new blocks are appended at the recent end.
        cap = self.top.capacity
        if cap is not None:
            while len(top) > cap:
                old = top.popitem(last=False)[0]
                changed[old] = None
                if ssd is not None:
                    for dropped in ssd.put(old):
                        changed[dropped] = None
        if changed:
            self._report(changed, t)

    def _report(self, affected: dict[int, None], t: float) -> None:
        """Tell the index where each affected block ended up (exact, whatever the order)."""
        in_top: list[int] = []
        in_ssd: list[int] = []
        gone: list[int] = []
        top, ssd = self.top.blocks, self.ssd.blocks if self.ssd else {}
        for h in affected:
            (in_top if h in top else in_ssd if h in ssd else gone).append(h)
        self.num_evicted += len(gone)
        if self.index is not None:
            self.index.add(self.node, in_top, self.top.name)
            if in_ssd:
                self.index.demote(self.node, in_ssd, "ssd")
            if gone:
                self.index.evict(self.node, gone)
                if self.ledger is not None:
                    self.ledger.dropped(gone, t)

    def check_integrity(self) -> None:
        assert self.top.capacity is None or len(self.top) <= self.top.capacity, self.node
        if self.ssd is not None:
            assert self.ssd.capacity is None or len(self.ssd) <= self.ssd.capacity, self.node
            assert not set(self.top.blocks) & set(self.ssd.blocks), "block in two tiers"


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
