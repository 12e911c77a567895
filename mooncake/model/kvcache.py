"""Paged KV in device memory: a block allocator and one K and one V tensor per layer.

A block holds `block_tokens` consecutive tokens of one sequence, the same unit as a prefix
hash and a KV object of the pool, so a pool object maps onto exactly one cache block:

    k[layer]  (num_blocks, block_tokens, num_kv_heads, head_dim)   same for v
    k[layer][block_id]   one block of one layer: the K half of that layer in its KV object

A sequence owns a block table (list of block ids); token i lives in block table[i // B] at
offset i % B. A stage's cache holds only the layers the stage owns.
"""

from __future__ import annotations

import heapq
import threading

import torch
from torch import Tensor

from mooncake.errors import MooncakeError
from mooncake.model.llama import Model


class CacheFullError(MooncakeError):
    """The paged KV cache has too few free blocks for a request: retry later or elsewhere."""


class BlockAllocator:
    """Lowest-id-first allocator of block ids (a heap), so that a sequence's blocks tend
    to be consecutive and attention can read them in place; all-or-nothing. A block can be
    `share`d (the choices of one request read its prompt's blocks): it is freed when its
    last holder frees it. Thread-safe (a decode node's RPC handlers reserve blocks while its
    step loop grows and frees others); its lock is held for the heap operations only."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._used: set[int] = set()
        self._num_shares: dict[int, int] = {}  # block id -> holders past the first
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` block ids, or None (nothing taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            ids = [heapq.heappop(self._free) for _ in range(n)]
            self._used.update(ids)
        return ids

    def share(self, ids: list[int]) -> None:
        """One more holder of each of `ids` (allocated): each must be freed once more."""
        with self._lock:
            for i in ids:
                assert i in self._used, f"block {i} shared but not allocated"
                self._num_shares[i] = self._num_shares.get(i, 0) + 1

    def free(self, ids: list[int]) -> None:
        """One holder lets go of each of `ids`; the last one frees it."""
        with self._lock:
            for i in ids:
                assert i in self._used, f"block {i} freed but not allocated"
                shares = self._num_shares.pop(i, 0)
                if shares:
                    if shares > 1:
                        self._num_shares[i] = shares - 1
                    continue
                self._used.remove(i)
                heapq.heappush(self._free, i)

    def check_integrity(self) -> None:
        assert set(self._num_shares) <= self._used, "a shared block is not allocated"
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & self._used, f"blocks both free and used: {free & self._used}"
        assert len(free) + len(self._used) == self.num_blocks, (len(free), len(self._used))


class PagedKVCache:
    """K/V block tensors for layers [first_layer, end_layer) and their allocator."""

    def __init__(
        self,
        num_blocks: int,
        block_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        layer_range: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        self.block_tokens = block_tokens
        self.first_layer, self.end_layer = layer_range
        shape = (num_blocks, block_tokens, num_kv_heads, head_dim)
        num_local = self.end_layer - self.first_layer
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_local)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_local)]
        self.allocator = BlockAllocator(num_blocks)

    @classmethod
    def for_model(cls, model: Model, num_blocks: int, block_tokens: int) -> PagedKVCache:
        """A cache for the layers `model` owns (its rank's KV heads), on its device and dtype."""
        spec = model.spec
        param = next(model.parameters())
        return cls(
            num_blocks,
            block_tokens,
            model.num_kv_heads,
            spec.head_dim,
            (model.first_layer, model.end_layer),
            param.dtype,
            str(param.device),
        )

    @classmethod
    def over(
        cls, k: list[Tensor], v: list[Tensor], block_tokens: int, layers: range
    ) -> PagedKVCache:
        """A cache over tensors that exist already (another tensor-parallel rank's, as
        rank 0 maps them: model/tprun.py `TensorParallel.place`); its allocator is
        unused (rank 0's decides every rank's block ids)."""
        cache = cls.__new__(cls)
        cache.block_tokens = block_tokens
        cache.first_layer, cache.end_layer = layers.start, layers.stop
        cache.k, cache.v = list(k), list(v)
        cache.allocator = BlockAllocator(k[0].shape[0])
        return cache

    @staticmethod
    def block_bytes_per_layer(
        block_tokens: int, num_kv_heads: int, head_dim: int, elem: int
    ) -> int:
        """Bytes of one block's K plus V in one layer."""
        return 2 * block_tokens * num_kv_heads * head_dim * elem

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def layer(self, global_layer: int) -> tuple[Tensor, Tensor]:
        """(k, v) block tensors of `global_layer`, each (num_blocks, B, kv_heads, head_dim)."""
        i = global_layer - self.first_layer
        return self.k[i], self.v[i]

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for `num_tokens` tokens; raises CacheFullError when they do not fit now."""
        n = self.blocks_for(num_tokens)
        ids = self.allocator.allocate(n)
        if ids is None:
            raise CacheFullError(
                f"KV cache full: {num_tokens} tokens need {n} blocks, "
                f"{self.allocator.num_free} of {self.num_blocks} free"
            )
        return ids

    def free(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block dst[i] becomes a copy of block src[i], in every layer held here (K and V):
        two index uploads, then two ops per tensor, whatever the number of blocks."""
        assert len(src) == len(dst) and not set(src) & set(dst), (src, dst)
        if not src:
            return
        device = self.k[0].device if self.k else "cpu"
        src_idx = torch.tensor(src, device=device)
        dst_idx = torch.tensor(dst, device=device)
        for t in [*self.k, *self.v]:
            t.index_copy_(0, dst_idx, t.index_select(0, src_idx))

    def gather(
        self, global_layer: int, block_ids: list[int], num_tokens: int
    ) -> tuple[Tensor, Tensor]:
        """A copy of one sequence's K and V in one layer: (num_tokens, kv_heads, head_dim)."""
        k, v = self.layer(global_layer)
        idx = torch.tensor(block_ids, device=k.device)
        shape = (-1, *k.shape[2:])
        return (
            k.index_select(0, idx).reshape(shape)[:num_tokens],
            v.index_select(0, idx).reshape(shape)[:num_tokens],
        )
