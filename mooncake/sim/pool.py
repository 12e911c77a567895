"""The simulated KV pool: the pool nodes' tiers under the Store's eviction policy.

A `SimPool` is the simulated Store: every pool node's DRAM (VRAM for a coupled instance)
and optional SSD, counted in blocks, with one pool-wide recency order per tier
(`store/metadata/poolorder.py`, the code the Store's eviction runs), so the pool keeps its
capacity for distinct blocks:

- a block is written once: a write of a block the pool holds anywhere only refreshes it
  (the Store answers the put "exists"); a new block goes to the writer's node. When the
  writer's memory is full, the writer's first victim in the policy's order makes room:
  a spare copy gives up its slot, a last copy moves to the node with the most room, else
  to where the policy's first victim (evicted or demoted) was; the pool's first victim on
  the writer itself is evicted as usual. So the pool holds what it held before (its
  order decides what leaves), and a node keeps what it wrote most recently: the next turn
  of a conversation finds its prefix there, not scattered over the pool (the Store does
  the same, `store/metadata/eviction.py`'s `room_on_writer`);
- victims in the policy's order: spare copies (duplicates, SSD copies of blocks also in
  memory) before last copies, each least recently used first, pool-wide; a last copy in
  memory is demoted to SSD (its node's, else where the SSD's own victim frees room) when
  there is an SSD tier, else dropped;
- a block read off its node's SSD moves back to memory there (the Store promotes it);
- a replica the Conductor orders (hot-spot relief after a fetch) is made only into free
  room and within `replica_budget` of the pool's memory, as the Store's moves are.

The Store also keeps memory under its high watermark where victims can move down a tier
(it demotes ahead); the simulator demotes when room is needed, which holds the same
blocks in the pool. Every change reaches the Conductor's `PrefixIndex` per node as added
/ demoted / evicted, as the Store's events would, and, with a `MissLedger`, every use and
every drop reaches the ledger (times in seconds of simulated time, `conductor/misses.py`).

A `NodePool` is one node's handle on its pool (a pool of its own when none is given: a
coupled instance's local cache); each of its tiers is an `LruTier` (`sim/lru.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from mooncake.conductor.index import PrefixIndex
from mooncake.conductor.misses import MissLedger
from mooncake.sim.lru import LruTier
from mooncake.store.metadata.poolorder import PoolOrder

DEFAULT_REPLICA_BUDGET = 0.1  # share of the pool's memory duplicates may take ([store])


class SimPool:
    """The pool nodes' tiers, one eviction order over all of them (module docstring)."""

    def __init__(
        self,
        index: PrefixIndex | None = None,
        ledger: MissLedger | None = None,
        top_tier: str = "dram",
        replica_budget: float = DEFAULT_REPLICA_BUDGET,
    ):
        self.index = index
        self.ledger = ledger
        self.top_tier = top_tier
        self.replica_budget = replica_budget  # share of the pool's memory
        self.order: PoolOrder[int] = PoolOrder((top_tier, "ssd"))
        self.nodes: dict[str, NodePool] = {}
        # tier -> block -> nodes holding it there, oldest copy first
        self.holders: dict[str, dict[int, list[NodePool]]] = {top_tier: {}, "ssd": {}}
        self._changed: dict[NodePool, dict[int, None]] = {}  # reported at the end of a call
        self.free: dict[str, float] = {top_tier: 0, "ssd": 0}  # tier -> blocks free, all nodes
        # NOTE: a block's place in the top tier's pool order (a counter: the order's
        # appends and touches), and per node a heap of (place, block), each block filed at
        # or before its place (re-filed, or dropped when gone, as the top meets it), so a
        # node's first block in the pool's order is found without a scan
        self._place_of: dict[int, int] = {}  # block -> its place in the top tier's order
        self._heaps: dict[NodePool, list[tuple[int, int]]] = {}
        self._clock = itertools.count()
        self.num_relocated = 0  # last copies moved off a full writer to make it room
        # (node, tier) -> its blocks there that are spare copies (order.spare, per node)
        self._spare_on: dict[tuple[NodePool, str], set[int]] = {}
        # tier -> heap of (-room, join order, node), stale entries skipped (`_roomiest`)
        self._room_heap: dict[str, list[tuple[float, int, NodePool]]] = {top_tier: [], "ssd": []}
        self._joined: dict[NodePool, int] = {}
        self.top_capacity = 0  # blocks, the nodes' memory tiers together (unbounded: 0)
        self._num_ssd = 0  # nodes with an SSD tier

    def join(self, node: NodePool) -> None:
        assert node.node not in self.nodes, node.node
        self.nodes[node.node] = node
        self._heaps[node] = []
        self.free[self.top_tier] += node.top.room
        self.free["ssd"] += node.ssd.room if node.ssd is not None else 0
        self._joined[node] = len(self._joined)
        self.top_capacity += node.top.capacity or 0
        self._num_ssd += node.ssd is not None
        for tier in self._room_heap:
            self._room_changed(node, tier)

    @property
    def has_ssd(self) -> bool:
        return self._num_ssd > 0

    def tier_of(self, node: NodePool, tier: str) -> LruTier | None:
        return node.top if tier == self.top_tier else node.ssd

    # -- what the nodes call -----------------------------------------------------------

    def write(self, writer: NodePool, hashes: Sequence[int], t: float) -> None:
        """Blocks written (new) or read (held) by `writer` at `t`."""
        if self.ledger is not None:
            self.ledger.used(hashes, t)
        order, top = self.order, self.top_tier
        for h in hashes:
            if h in writer.top:
                self.touch_block(h)
            elif writer.ssd is not None and h in writer.ssd:
                self._promote(writer, h)
            elif h in order.copies:
                self.touch_block(h)  # NOTE: held elsewhere: the put says "exists"
            else:
                self._place(writer, h, top)
        self._report(t)

    def touch(self, hashes: Iterable[int], t: float) -> None:
        """Blocks read from wherever they are at `t` (a fetch): most recent everywhere."""
        held = [h for h in hashes if h in self.order.copies]
        if self.ledger is not None:
            self.ledger.used(held, t)
        for h in held:
            self.touch_block(h)

    def replicate(self, dst: NodePool, hashes: Sequence[int], t: float) -> int:
        """Copy blocks the pool holds to `dst`'s memory (a replica the Conductor ordered),
        into free room only and within the budget; returns the copies made."""
        if self.ledger is not None:
            self.ledger.used(hashes, t)
        top, order = self.top_tier, self.order
        capacity = self.top_capacity
        made = 0
        for h in hashes:
            self.touch_block(h)
            if h in dst.top or h not in order.copies or not dst.top.has_room:
                continue
            if not order.may_duplicate(top, 1, self.replica_budget, capacity):
                break
            self._add(dst, h, top)
            made += 1
        self._report(t)
        return made

    def touch_block(self, h: int) -> None:
        self.order.touch(h)
        if h in self._place_of:  # NOTE: the holders' heaps re-file h when they meet it
            self._place_of[h] = next(self._clock)  # (`_first_on`), not here: O(1) per copy
        top = self.top_tier
        for tier, table in self.holders.items():
            for node in table.get(h, ()):
                lru = node.top if tier == top else node.ssd
                assert lru is not None
                lru.blocks.move_to_end(h)

    # -- placement and eviction ----------------------------------------------------------

    def _place(self, writer: NodePool, h: int, tier: str) -> None:
        """A new block into `tier`: the writer's node (made room on when full), else (a
        writer without this tier) the roomiest, else where the first victim frees room;
        dropped (not stored) if the tier has no capacity."""
        own = self.tier_of(writer, tier)
        if own is not None and own.capacity != 0:
            if own.has_room or self._room_on_writer(writer, tier):
                self._add(writer, h, tier)
            return
        node = self._roomiest(tier) or self._make_room(tier)
        if node is not None:
            self._add(node, h, tier)

    def _room_on_writer(self, writer: NodePool, tier: str) -> bool:
        """Free one block of `tier` on the full `writer` (module docstring): its first
        victim gives up its slot (a spare copy) or moves where there is room (a last copy);
        the pool's first victim on the writer itself is evicted as usual."""
        mine = self._first_on(writer, tier)
        if mine is None:
            return False
        if mine in self.order.spare[tier]:
            self._remove(writer, mine, tier)
            return True
        dst = self._roomiest(tier) or self._make_room(tier)
        if dst is None:
            return False
        if dst is not writer:  # NOTE: else the pool's first victim was the writer's own
            self._relocate(writer, dst, mine, tier)
        return True

    def _first_on(self, node: NodePool, tier: str) -> int | None:
        """`node`'s first block of `tier` in the policy's order: spare copies first."""
        mine = self._spare_on.get((node, tier))
        if mine:  # NOTE: its spare copies, kept per node: the pool's are not sorted
            return min(mine, key=self.order._stamp.__getitem__)  # the order's recency
        heap, lru, place = self._heaps[node], self.tier_of(node, tier), self._place_of
        assert tier == self.top_tier and lru is not None, (node.node, tier)
        # NOTE: every block on the node has an entry at or before its place (places only
        # grow): the first entry at its block's place is the node's first block
        while heap:
            at, h = heap[0]
            if h in lru:
                current = place[h]
                if current == at:
                    return h
                heapq.heapreplace(heap, (current, h))  # touched since: re-filed at its place
            else:
                heapq.heappop(heap)  # NOTE: stale: gone from the node
        return None

    def _relocate(self, src: NodePool, dst: NodePool, h: int, tier: str) -> None:
        """Move `h`'s copy in `tier` from `src` to `dst`, keeping its place in the pool's
        order (the Store's relocation: the same object, elsewhere)."""
        src_lru, dst_lru = self.tier_of(src, tier), self.tier_of(dst, tier)
        assert src_lru is not None and dst_lru is not None and h not in dst_lru, h
        self._changed.setdefault(dst, {})[h] = None
        src_lru.remove(h)
        dst_lru.blocks[h] = None
        nodes = self.holders[tier][h]
        nodes[nodes.index(src)] = dst
        self._spare_on.get((src, tier), set()).discard(h)
        self._resync(h)
        self._room_changed(src, tier)
        self._room_changed(dst, tier)
        heapq.heappush(self._heaps[dst], (self._place_of[h], h))
        self._changed.setdefault(src, {})[h] = None
        self.num_relocated += 1

    def _roomiest(self, tier: str) -> NodePool | None:
        """The node with the most room in `tier` (the first joined of equals), None when
        none has any: the top of a heap of (room, join order) with stale entries skipped."""
        if not self.free[tier]:
            return None
        heap = self._room_heap[tier]
        while heap:
            neg_room, _, node = heap[0]
            lru = self.tier_of(node, tier)
            if lru is not None and lru.room == -neg_room:
                return node if -neg_room > 0 else None
            heapq.heappop(heap)
        return None

    def _room_changed(self, node: NodePool, tier: str) -> None:
        lru = self.tier_of(node, tier)
        if lru is not None:
            heapq.heappush(self._room_heap[tier], (-lru.room, self._joined[node], node))

    def _make_room(self, tier: str) -> NodePool | None:
        """Free one block of `tier` by the policy's first victim; the node freed, or None
        when the tier holds nothing."""
        for h in self.order.victims(tier):
            nodes = self.holders[tier][h]
            if h in self.order.spare[tier]:
                node = nodes[-1]  # NOTE: the newest copy: a duplicate goes before the original
                self._remove(node, h, tier)
                return node
            node = nodes[0]
            self._remove(node, h, tier)
            if tier == self.top_tier and self.has_ssd:
                self._demote(node, h)
            return node
        return None

    def _demote(self, node: NodePool, h: int) -> None:
        """`h`'s last memory copy left `node`: onto its SSD, else another node's, else
        where the SSD's own first victim frees room (the lowest tier drops)."""
        dst: NodePool | None = node if node.ssd is not None and node.ssd.has_room else None
        if dst is None:
            dst = self._roomiest("ssd") or self._make_room("ssd")
        if dst is not None:
            self._add(dst, h, "ssd")

    def _promote(self, node: NodePool, h: int) -> None:
        """`h`, on `node`'s SSD, is read: it moves back to memory there."""
        self._remove(node, h, "ssd")
        top = self.top_tier
        if not node.top.has_room:
            freed = self._make_room_on(node, top)
            if not freed:  # NOTE: nothing on this node can go: it stays on SSD
                self._add(node, h, "ssd")
                return
        self._add(node, h, top)

    def _make_room_on(self, node: NodePool, tier: str) -> bool:
        """Free one block of `tier` on `node` in the policy's order (a promotion lands on
        the reader's node)."""
        for h in self.order.victims(tier):
            if node in self.holders[tier][h]:
                last = h not in self.order.spare[tier]
                self._remove(node, h, tier)
                if last and tier == self.top_tier and self.has_ssd:
                    self._demote(node, h)
                return True
        return False

    # -- bookkeeping ---------------------------------------------------------------------

    def _add(self, node: NodePool, h: int, tier: str) -> None:
        lru = self.tier_of(node, tier)
        assert lru is not None and h not in lru, (node.node, h, tier)
        lru.blocks[h] = None
        self.free[tier] -= 1
        self.holders[tier].setdefault(h, []).append(node)
        self.order.add(h, tier)
        self._resync(h)
        self._room_changed(node, tier)
        if tier == self.top_tier:
            if h not in self._place_of:  # NOTE: a duplicate keeps the original's place
                self._place_of[h] = next(self._clock)
            heapq.heappush(self._heaps[node], (self._place_of[h], h))
        self._changed.setdefault(node, {})[h] = None

    def _remove(self, node: NodePool, h: int, tier: str) -> None:
        lru = self.tier_of(node, tier)
        assert lru is not None
        lru.remove(h)
        self.free[tier] += 1
        nodes = self.holders[tier][h]
        nodes.remove(node)
        if not nodes:
            del self.holders[tier][h]
            if tier == self.top_tier:
                del self._place_of[h]
        self.order.remove(h, tier)
        self._spare_on.get((node, tier), set()).discard(h)
        self._resync(h)
        self._room_changed(node, tier)
        self._changed.setdefault(node, {})[h] = None

    def _resync(self, h: int) -> None:
        """Each holder of `h` files it as spare or not, as the order classes it now."""
        for tier, table in self.holders.items():
            nodes = table.get(h)
            if nodes:
                is_spare = h in self.order.spare[tier]
                for node in nodes:
                    mine = self._spare_on.setdefault((node, tier), set())
                    if is_spare:
                        mine.add(h)
                    else:
                        mine.discard(h)

    def _report(self, t: float) -> None:
        """Tell the index where each changed block ended up on each node, then the ledger
        which blocks left (a block moved between nodes is not one)."""
        gone = [h for node, blocks in self._changed.items() for h in node.report(blocks)]
        self._changed = {}
        if gone and self.ledger is not None:
            self.ledger.dropped(gone, t)

    def check_integrity(self) -> None:
        self.order.check_integrity()
        for tier, table in self.holders.items():
            for h, nodes in table.items():
                assert nodes and all(h in (self.tier_of(n, tier) or ()) for n in nodes), h
            lrus = [lru for n in self.nodes.values() if (lru := self.tier_of(n, tier)) is not None]
            assert sum(map(len, lrus)) == sum(len(v) for v in table.values()), tier
            room = sum(lru.room for lru in lrus)  # NOTE: not `or`: an empty tier is falsy
            assert self.free[tier] == room, (tier, self.free[tier], room)
        assert set(self._place_of) == set(self.holders[self.top_tier]), "places out of sync"
        every = list(self.nodes.values())
        assert self.top_capacity == sum(n.top.capacity or 0 for n in every), self.top_capacity
        assert self._num_ssd == sum(n.ssd is not None for n in every), self._num_ssd
        for node in self.nodes.values():
            node.check_integrity()
        for (node, tier), mine in self._spare_on.items():
            want = {h for h in self.order.spare[tier] if node in self.holders[tier].get(h, ())}
            assert mine == want, (node.node, tier, mine ^ want)


class NodePool:
    """One node's share of a pool (memory tier, optional SSD tier); a pool of its own
    when `pool` is None."""

    def __init__(
        self,
        node: str,
        dram_blocks: int | None,
        ssd_blocks: int = 0,
        index: PrefixIndex | None = None,
        top_tier: str = "dram",
        ledger: MissLedger | None = None,
        pool: SimPool | None = None,
    ):
        self.node = node
        self.top = LruTier(top_tier, dram_blocks)
        self.ssd = LruTier("ssd", ssd_blocks) if ssd_blocks else None
        self.pool = pool if pool is not None else SimPool(index, ledger, top_tier)
        assert self.pool.top_tier == top_tier, (self.pool.top_tier, top_tier)
        self.index = self.pool.index
        self.ledger = self.pool.ledger
        self.num_evicted = 0  # blocks dropped from the node
        self.pool.join(self)

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
        """Blocks were read at `t` (a fetch from here): the most recent in the pool."""
        self.pool.touch(hashes, t)

    def store(self, hashes: Sequence[int], t: float) -> None:
        """Blocks were written or read here at `t`: new ones stored, held ones refreshed,
        ones on this node's SSD moved back to memory."""
        self.pool.write(self, hashes, t)

    def replicate(self, hashes: Sequence[int], t: float) -> int:
        """A copy here of blocks the pool holds elsewhere (room and budget permitting)."""
        return self.pool.replicate(self, hashes, t)

    def report(self, affected: dict[int, None]) -> list[int]:
        """Tell the index where each affected block ended up here (exact, whatever the
        order of the changes); returns those no longer here."""
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
        return gone

    def check_integrity(self) -> None:
        assert self.top.capacity is None or len(self.top) <= self.top.capacity, self.node
        if self.ssd is not None:
            assert self.ssd.capacity is None or len(self.ssd) <= self.ssd.capacity, self.node
