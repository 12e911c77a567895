"""A node's paged KV cache as Transfer Engine segments, the ends of every KV hand-off.

Each layer's K and V tensors are registered with the node's Transfer Engine, one segment
per layer and half (`{prefix}k{layer}`, `{prefix}v{layer}`); on a CPU node the block
tensors live in shared memory, so a process on the same host copies straight into them
(the `shm` transport), and over `tcp`/`rdma` otherwise. A block of layer l starts at
`block * block_bytes` in its segment, so a stage writes one-sided from its cache into the
blocks a decode node reserved (kv/stream.py):

    cache.k[l][src_block]  ---->   {decode prefix}k{l} at dst_block * block_bytes

A tensor-parallel instance registers every rank's cache, rank r's under
`rank_prefix(prefix, r, ranks)` (`{prefix}tp{r}.`; the plain prefix at TP = 1), from
rank 0's process (model/tprun.py `TensorParallel.place`), with each GPU rank's
segments located on its own GPU, so that its KV goes out through the NIC nearest it.
"""

from __future__ import annotations

from typing import Any

import torch

from mooncake.model.kvcache import PagedKVCache
from mooncake.transfer import TransferEngine


def segment_name(prefix: str, layer: int, half: str) -> str:
    return f"{prefix}{half}{layer}"


def rank_prefix(prefix: str, rank: int, ranks: int) -> str:
    """The segment prefix of tensor-parallel rank `rank` of `ranks`' cache."""
    return prefix if ranks == 1 else f"{prefix}tp{rank}."


def place_cache_in_segments(
    engine: TransferEngine, cache: PagedKVCache, prefix: str, tp: Any = None
) -> list[PagedKVCache]:
    """Register every layer's K and V tensors as Transfer Engine segments. On CPU the
    tensors are first moved into engine-allocated shared memory (same-host peers then copy
    with the shm transport); on a GPU they are registered where they are. With `tp` (a
    `parallel.TensorParallel`), every rank's cache is, rank r's under its `rank_prefix`.
    Returns every rank's cache as this process addresses it, rank 0's (`cache`) first."""
    ranks = 1 if tp is None else tp.size
    _place(engine, cache, rank_prefix(prefix, 0, ranks))
    if tp is None:
        return [cache]
    return [cache, *tp.place(engine, lambda r: rank_prefix(prefix, r, ranks))]


def _place(engine: TransferEngine, cache: PagedKVCache, prefix: str) -> None:
    for i, layer in enumerate(range(cache.first_layer, cache.end_layer)):
        for half, tensors in (("k", cache.k), ("v", cache.v)):
            name = segment_name(prefix, layer, half)
            t = tensors[i]
            if t.device.type == "cpu":
                arr = engine.allocate(name, t.numel() * t.element_size())
                shm = torch.from_numpy(arr).view(t.dtype).view(t.shape)
                shm.copy_(t)
                tensors[i] = shm
            else:
                engine.register(name, t, f"cuda:{t.device.index or 0}")


def block_bytes(cache: PagedKVCache) -> int:
    """Bytes of one block of one layer's K (or V)."""
    t = cache.k[0]
    return t[0].numel() * t.element_size()
