"""A node's paged KV cache as Transfer Engine segments, the ends of every KV hand-off.

Each layer's K and V tensors are registered with the node's Transfer Engine, one segment
per layer and half (`{prefix}k{layer}`, `{prefix}v{layer}`); on a CPU node the block
tensors live in shared memory, so a process on the same host copies straight into them
(the `shm` transport), and over `tcp`/`rdma` otherwise. A block of layer l starts at
`block * block_bytes` in its segment, so a stage writes one-sided from its cache into the
blocks a decode node reserved (kv/stream.py):

    cache.k[l][src_block]  ---->   {decode prefix}k{l} at dst_block * block_bytes
"""

from __future__ import annotations

import torch

from mooncake.model.kvcache import PagedKVCache
from mooncake.transfer import TransferEngine


def segment_name(prefix: str, layer: int, half: str) -> str:
    return f"{prefix}{half}{layer}"


def place_cache_in_segments(engine: TransferEngine, cache: PagedKVCache, prefix: str) -> None:
    """Register every layer's K and V tensors as Transfer Engine segments. On CPU the
    tensors are first moved into engine-allocated shared memory (same-host peers then copy
    with the shm transport); on a GPU they are registered where they are."""
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
