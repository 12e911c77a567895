"""Global prefix index: which nodes (and which tier) hold each KV block.

Keys are block hashes, opaque and hashable (the real cluster's 128-bit prefix-chained
ints, the trace's `hash_ids`). Every change the Store reports arrives as an `IndexUpdate`
(added, evicted, demoted, node gone: the master's feed, roles/master/storefeed.py, turns
the Store's events into these); the Conductor asks `prefix_lens`: for each candidate node,
how many leading blocks of a request it holds, and `pool_prefix_len`: how many the pool
holds, wherever each block is.

NOTE: nodes are bits of an int, so a block's holders are one bitmask (`_any`) and the
match walks the request's hashes once, AND-ing masks, whatever the number of nodes; a
node's tier for a block is the tier whose mask has its bit: its fastest (a node may keep
a copy lower too, as the Store does, but a reader reads the fastest, so the events only
report that one).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Literal

import msgspec

TIERS = ("vram", "dram", "ssd")  # fastest first


class IndexUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """A change of the pool's contents for this index: blocks of a node added, evicted or
    demoted, or the node gone (from the Store's events, mooncake.store's `StoreEvent`)."""

    kind: Literal["added", "evicted", "demoted", "node_gone"]
    node: str
    block_hashes: tuple[Hashable, ...] = ()
    tier: str = "dram"  # added: where it lives; demoted: the tier it moved to


class PrefixIndex:
    """block hash -> nodes holding it, per tier. Mutated only by store events."""

    def __init__(self) -> None:
        self._node_bit: dict[str, int] = {}  # node -> its bit
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._any: dict[Hashable, int] = {}  # hash -> mask of holders, any tier
        self._tier: dict[str, dict[Hashable, int]] = {t: {} for t in TIERS}  # tier -> hash -> mask
        self.node_blocks: dict[str, int] = {}  # node -> number of blocks it holds

    def __len__(self) -> int:
        return len(self._any)

    def bit(self, node: str) -> int:
        """The node's bit (registering the node on first use)."""
        bit = self._node_bit.get(node)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = 1 << self._next_bit, self._next_bit + 1
            self._node_bit[node] = bit
            self.node_blocks[node] = 0
        return bit

    def apply(self, update: IndexUpdate) -> None:
        """Apply one update."""
        if update.kind == "added":
            self.add(update.node, update.block_hashes, update.tier)
        elif update.kind == "evicted":
            self.evict(update.node, update.block_hashes)
        elif update.kind == "demoted":
            self.demote(update.node, update.block_hashes, update.tier)
        else:
            self.remove_node(update.node)

    def add(self, node: str, hashes: Iterable[Hashable], tier: str = "dram") -> None:
        """`node` now holds these blocks in `tier` (moved there if it held them elsewhere)."""
        bit, tiers, table, anyt = self.bit(node), self._tier, self._tier[tier], self._any
        for h in hashes:
            mask = anyt.get(h, 0)
            if mask & bit:
                if table.get(h, 0) & bit:
                    continue
                self._drop_tiers(h, bit, tiers)
            else:
                anyt[h] = mask | bit
                self.node_blocks[node] += 1
            table[h] = table.get(h, 0) | bit

    def demote(self, node: str, hashes: Iterable[Hashable], tier: str) -> None:
        """These blocks moved to a lower `tier` on `node` (added there if unknown)."""
        self.add(node, hashes, tier)

    def evict(self, node: str, hashes: Iterable[Hashable]) -> None:
        """`node` no longer holds these blocks (unknown ones are ignored)."""
        bit = self._node_bit.get(node)
        if bit is None:
            return
        anyt, tiers = self._any, self._tier
        for h in hashes:
            mask = anyt.get(h, 0)
            if not mask & bit:
                continue
            self._drop_tiers(h, bit, tiers)
            mask &= ~bit
            if mask:
                anyt[h] = mask
            else:
                del anyt[h]
            self.node_blocks[node] -= 1

    @staticmethod
    def _drop_tiers(h: Hashable, bit: int, tiers: dict[str, dict[Hashable, int]]) -> None:
        for table in tiers.values():
            m = table.get(h, 0)
            if m & bit:
                if m == bit:
                    del table[h]
                else:
                    table[h] = m & ~bit

    def remove_node(self, node: str) -> None:
        """The node is gone: forget everything it held (one pass over the index)."""
        bit = self._node_bit.pop(node, None)
        if bit is None:
            return
        for table in (self._any, *self._tier.values()):
            for h in [h for h, m in table.items() if m & bit]:
                m = table[h] & ~bit
                if m:
                    table[h] = m
                else:
                    del table[h]
        self.node_blocks.pop(node, None)
        self._free_bits.append(bit)

    def holders(self, h: Hashable) -> dict[str, str]:
        """node -> tier for every node holding block `h`."""
        return {
            node: tier
            for tier, table in self._tier.items()
            for node, bit in self._node_bit.items()
            if table.get(h, 0) & bit
        }

    def prefix_lens(
        self, hashes: Sequence[Hashable], bits: Sequence[int], full: int | None = None
    ) -> list[int]:
        """For each candidate node (given by its bit), how many leading `hashes` it holds.
        `full` is the OR of `bits`, when the caller keeps it."""
        n, get = len(hashes), self._any.get
        if full is None:
            full = 0
            for b in bits:
                full |= b
        alive = full
        drops: list[tuple[int, int]] = []  # (position, bits whose match ended there)
        for i, h in enumerate(hashes):
            m = alive & get(h, 0)
            if m != alive:
                drops.append((i, alive ^ m))
                alive = m
                if not alive:
                    break
        if not drops:  # every candidate holds everything, or there are none
            return [n] * len(bits)
        if len(drops) == 1:
            at, gone = drops[0]
            return [at if b & gone else n for b in bits]
        lens = []
        for b in bits:
            for at, gone in drops:
                if b & gone:
                    lens.append(at)
                    break
            else:
                lens.append(n)
        return lens

    def prefix_groups(self, hashes: Sequence[Hashable], full: int) -> list[tuple[int, int]]:
        """The nodes of mask `full` holding a prefix of `hashes`, grouped by its length:
        (length >= 1, mask of the nodes whose leading match is exactly that long), longest
        last; a node of `full` in no group holds nothing of it. One walk of the hashes,
        whatever the number of nodes."""
        get, alive = self._any.get, full
        groups: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            m = alive & get(h, 0)
            if m != alive:
                if i:
                    groups.append((i, alive ^ m))
                alive = m
                if not alive:
                    return groups
        if alive and hashes:
            groups.append((len(hashes), alive))
        return groups

    def holders_mask(self, h: Hashable) -> int:
        """The bits of the nodes holding block `h` (0: none)."""
        return self._any.get(h, 0)

    def pool_prefix_len(self, hashes: Sequence[Hashable], full: int) -> int:
        """How many leading `hashes` the pool holds, each on some node of mask `full`: the
        global pool's prefix, which may be split across nodes (blocks a prefill node
        wrote, then blocks a decode node stored from the answer)."""
        get, n = self._any.get, 0
        for h in hashes:
            if not get(h, 0) & full:
                break
            n += 1
        return n

    def ssd_only_counts(self, hashes: Sequence[Hashable], full: int) -> list[int]:
        """Running counts over the pool's prefix of `hashes` (held on some node of mask
        `full`) of the blocks held there on SSD only (no node of `full` has them in
        memory): entry i counts blocks 0..i-1, so a reader of the first n blocks reads
        entry n of them off an SSD. [] when no block is on SSD anywhere."""
        ssd = self._tier["ssd"]
        if not ssd:
            return []
        get_any, dram, vram = self._any.get, self._tier["dram"], self._tier["vram"]
        counts, n = [0], 0
        for h in hashes:
            if not get_any(h, 0) & full:
                break
            if ssd.get(h, 0) & full and not (dram.get(h, 0) | vram.get(h, 0)) & full:
                n += 1
            counts.append(n)
        return counts

    def check_integrity(self) -> None:
        """Assert the masks agree: `_any` is the union of the tiers, tiers are disjoint,
        no empty entries, only registered bits, and the per-node counts match."""
        known = 0
        for bit in self._node_bit.values():
            known |= bit
        union: dict[Hashable, int] = {}
        for tier, table in self._tier.items():
            for h, m in table.items():
                assert m and not m & ~known, (tier, h, m)
                assert not union.get(h, 0) & m, ("block in two tiers of one node", h)
                union[h] = union.get(h, 0) | m
        assert union == self._any, "tier masks disagree with the any-tier index"
        for node, bit in self._node_bit.items():
            count = sum(1 for m in self._any.values() if m & bit)
            assert count == self.node_blocks[node], (node, count, self.node_blocks[node])
