"""`BlockMap`: one vLLM instance's KV events as changes of the Conductor's prefix index.

vLLM names a block by a hash we cannot compute (sha256 over its parent's hash, the token
ids and extra keys, seeded per deployment: docs/kv-events.md), but every `BlockStored`
carries the blocks' token ids and its parent's vLLM hash. So the map re-hashes the tokens
with our chained hash (`mooncake.kv.hashing.PrefixHasher`, the one requests are matched by),
from the parent's hash of ours, and remembers vLLM hash -> ours so that `BlockRemoved`
(hashes only) can be applied. Blocks whose parent it never saw (a feed joined late, with
no replay to fill the gap), of another block size, or with extra keys (LoRA, multimodal
inputs, cache salt: a different prefix than the tokens say) are not indexed and counted
in `num_skipped`. Pure logic: the caller holds the Conductor's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from mooncake.conductor.index import PrefixIndex
from mooncake.kv.hashing import PrefixHasher
from mooncake.kvevents.wire import (
    MEDIUM_TO_TIER,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

log = logging.getLogger(__name__)


class BlockMap:
    """vLLM block hash -> our block hash, for instance `name` of the index."""

    def __init__(self, name: str, index: PrefixIndex, hasher: PrefixHasher):
        self.name = name
        self.index = index
        self.hasher = hasher
        self._ours: dict[BlockHash, int] = {}  # vLLM's hash -> ours
        self.num_skipped = 0  # blocks stored but not indexed (module docstring)

    def __len__(self) -> int:
        return len(self._ours)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a batch's events in order (changes the index)."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                ours: list[Hashable] = [
                    self._ours.pop(h) for h in ev.block_hashes if h in self._ours
                ]
                self.index.evict(self.name, ours)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        """The instance holds nothing (cleared, or restarted)."""
        self.index.evict(self.name, list(self._ours.values()))
        self._ours.clear()

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        parent = None if ev.parent_block_hash is None else self._ours.get(ev.parent_block_hash)
        if (
            ev.block_size != self.hasher.block_tokens
            or len(ev.token_ids) != n * ev.block_size
            or (ev.parent_block_hash is not None and parent is None)
            or ev.lora_name is not None
            or (ev.extra_keys and any(k for k in ev.extra_keys))
        ):
            if ev.block_size != self.hasher.block_tokens and not self.num_skipped:
                log.error(
                    "router: %s stores blocks of %d tokens, router.block_tokens is %d: "
                    "its cache cannot be matched (set them equal)",
                    self.name,
                    ev.block_size,
                    self.hasher.block_tokens,
                )
            self.num_skipped += n
            return
        ours = self.hasher.hash_blocks(ev.token_ids, parent)
        for theirs, mine in zip(ev.block_hashes, ours, strict=True):
            self._ours[theirs] = mine
        self.index.add(self.name, ours, MEDIUM_TO_TIER.get(ev.medium or "GPU", "vram"))
