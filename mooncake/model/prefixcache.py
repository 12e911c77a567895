"""Automatic prefix caching on one instance (as vLLM's): reuse the KV of full blocks an
earlier request already computed for the same prefix.

Every block a running sequence holds has a reference count. Once a block is full and its
KV computed, it is registered under its chained prefix hash (`hashing.PrefixHasher`: block
i's hash covers every token up to the end of block i, so equal hashes mean equal
prefixes). A new request looks up the hashes of its prompt's full blocks, longest prefix
first, and takes a reference on each block found instead of computing it. When the last
reference is dropped, a registered block is not freed but kept as "evictable", in least
recently used order; allocation takes free blocks first, then evicts the oldest evictable
ones (their hash is forgotten; a sequence's last block goes before its first, so what
survives is still a prefix). Blocks that are never written again are the only ones
registered: a sequence writes only at positions past its computed tokens, so a shared
block is read-only.

The hash seed is random per process: the cache is local, its names are never shared.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

from mooncake.kv.hashing import PrefixHasher
from mooncake.model.kvcache import PagedKVCache


class PrefixCache:
    """The block manager of a `PagedKVCache` with prefix reuse and LRU eviction."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.block_tokens = cache.block_tokens
        self.hasher = PrefixHasher(cache.block_tokens, os.urandom(16), bytes(16))
        self._block_of: dict[int, int] = {}  # block hash -> block id
        self._hash_of: dict[int, int] = {}  # block id -> block hash (registered blocks)
        self._refs: dict[int, int] = {}  # block id -> sequences holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld; LRU first
        self.num_queried_tokens = 0  # prompt tokens looked up since start
        self.num_hit_tokens = 0  # of those, found in the cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get now (free ones and evictable ones)."""
        return self.cache.allocator.num_free + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids`' full blocks, leaving at
        least the last token to compute (its logits are needed); takes a reference on each."""
        bt = self.block_tokens
        limit = (len(token_ids) - 1) // bt
        blocks: list[int] = []
        for h in self.hasher.hash_blocks(token_ids[: limit * bt]):
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self._hold(block)
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(blocks) * bt
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """One more reference on each of `block_ids` (held): the choices of one request
        read its prompt's blocks; each holder releases them."""
        for block in block_ids:
            assert block in self._refs, f"block {block} shared but not held"
            self._hold(block)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks (free ones first, then the least recently used evictable ones), each
        with one reference; None (nothing taken) when fewer are available."""
        allocator = self.cache.allocator
        if n > self.num_free:
            return None
        while allocator.num_free < n:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            allocator.free([block])
        ids = allocator.allocate(n)
        assert ids is not None, (n, allocator.num_free)
        for block in ids:
            self._refs[block] = 1
        return ids

    def release(self, token_ids: Sequence[int], block_ids: list[int], num_computed: int) -> None:
        """A sequence lets go of its blocks: its full blocks among the first `num_computed`
        tokens (whose KV is in them) are registered first, so later requests can reuse them."""
        self.register(token_ids, block_ids, num_computed)
        for block in reversed(block_ids):  # a prefix's tail is evicted before its head
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None  # the most recently used end
            else:
                self.cache.allocator.free([block])

    def register(self, token_ids: Sequence[int], block_ids: list[int], num_computed: int) -> None:
        """Name the full blocks of `token_ids[:num_computed]` by their prefix hashes. A
        block whose prefix another block already holds stays unnamed (freed on release)."""
        num_full = min(num_computed // self.block_tokens, len(block_ids))
        hashes = self.hasher.hash_blocks(token_ids[: num_full * self.block_tokens])
        for block, h in zip(block_ids[:num_full], hashes, strict=True):
            if block not in self._hash_of and h not in self._block_of:
                self._block_of[h], self._hash_of[block] = block, h

    def _hold(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def check_integrity(self) -> None:
        """Every block is free, held or evictable, exactly once (tests)."""
        self.cache.allocator.check_integrity()
        free = set(self.cache.allocator._free)
        held, evictable = set(self._refs), set(self._evictable)
        assert not held & evictable and not (held | evictable) & free, "a block in two states"
        assert len(free | held | evictable) == self.cache.num_blocks, "a block is lost"
        assert evictable <= set(self._hash_of), "an unnamed block is evictable"
        assert {self._block_of[h] for h in self._hash_of.values()} == set(self._hash_of)
