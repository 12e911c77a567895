"""`PoolEvents`: the Store's pool changes as vLLM KV event batches.

The pool is many nodes' caches. vLLM's format describes one engine's cache per
`data_parallel_rank`, so each pool node is given a rank of its own (in the order the feed
first sees it, never reused while the master runs; `ranks` has the map): a node's
replicas are `BlockStored` / `BlockRemoved` under its rank, `medium` saying the tier
("GPU" vram, "CPU" dram, "STORAGE" ssd), and a node whose segments were lost
(heartbeats lapsed) is one `AllBlocksCleared` under its rank. A move between tiers of
one node (demotion, promotion) is `BlockRemoved` from the old medium then `BlockStored`
in the new one. A consumer that ignores ranks sees the union of the pool's nodes, except
that a node's `AllBlocksCleared` then reads as the whole pool's.

A block's hash is our 128-bit prefix hash (`mooncake.kv.hashing`) as 16 big-endian bytes;
its token ids are not known to the master (the Store keeps bytes under a key), so
`BlockStored` carries `token_ids=[]` and `parent_block_hash=None` (docs/kv-events.md says
how a router uses these hashes). Keys that do not name a KV block are not reported.
Pure logic: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mooncake.kv.keys import parse_kv_key
from mooncake.kvevents.wire import (
    TIER_TO_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from mooncake.store.metadata.objects import StoreEvent


def block_hash_bytes(block_hash: int) -> bytes:
    """Our 128-bit block hash as it goes on the wire."""
    return block_hash.to_bytes(16, "big")


class PoolEvents:
    """Translates StoreEvents; remembers each node's tier per block (to name the medium a
    block leaves) and each node's rank."""

    def __init__(self, block_tokens: int, clock: Callable[[], float] = time.time):
        self.block_tokens = block_tokens  # block_size in every BlockStored
        self.ranks: dict[str, int] = {}  # node id -> its data_parallel_rank
        self._tier: dict[str, dict[bytes, str]] = {}  # node -> block hash -> its tier there
        self._clock = clock

    def translate(self, events: list[StoreEvent]) -> list[KVEventBatch]:
        """One batch per node the events touch, in the order the nodes first appear."""
        by_node: dict[str, list[Event]] = {}
        for e in events:
            out = by_node.setdefault(e.node_id, [])
            if e.kind == "node_gone":
                self._tier.pop(e.node_id, None)
                out.append(AllBlocksCleared())
                continue
            h = parse_kv_key(e.key)
            if h is None or e.kind == "lost":  # lost: its replicas' own events said it
                continue
            self._apply(e, block_hash_bytes(h), out)
        now = self._clock()
        return [
            KVEventBatch(ts=now, events=evs, data_parallel_rank=self._rank(node))
            for node, evs in by_node.items()
            if evs
        ]

    def _apply(self, e: StoreEvent, h: bytes, out: list[Event]) -> None:
        tiers = self._tier.setdefault(e.node_id, {})
        old = tiers.get(h)
        if e.kind in ("evicted", "removed"):
            if old is not None:
                del tiers[h]
                out.append(BlockRemoved(block_hashes=[h], medium=TIER_TO_MEDIUM[old]))
            return
        new = e.tier or "dram"  # added, demoted, promoted: the node's tier for it now
        if old == new:
            return
        if old is not None:
            out.append(BlockRemoved(block_hashes=[h], medium=TIER_TO_MEDIUM[old]))
        tiers[h] = new
        out.append(
            BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.block_tokens,
                lora_id=None,
                medium=TIER_TO_MEDIUM.get(new, new),
                lora_name=None,
            )
        )

    def _rank(self, node: str) -> int:
        rank = self.ranks.get(node)
        if rank is None:
            rank = self.ranks[node] = len(self.ranks)
        return rank
