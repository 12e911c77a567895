"""Handing a request's KV from a prefill node to a decode node (Transfer Engine writes).

The decode node's paged KV cache is registered with its Transfer Engine, one segment per
layer and half (`{prefix}k{layer}`, `{prefix}v{layer}`); on a CPU node the block tensors
live in shared memory, so a prefill process on the same host copies straight into them
(the `shm` transport), and over `tcp`/`rdma` otherwise. The prefill node writes block by
block, one-sided, into the blocks the decode node reserved:

    source                         destination (decode segment of layer l)
    cache.k[l][src_block]  ---->   {prefix}k{l} at dst_block * block_bytes
    remote K (tokens, h, d) rows [i*B, i*B+n)  ---->  {prefix}k{l} at dst_block_i * block_bytes

Later pipeline stages' layers arrive at the leader as contiguous tensors (`remote_kv`);
those are registered for the duration of one handoff.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from mooncake.engine.kvcache import PagedKVCache
from mooncake.transfer import TransferEngine, TransferRequest
from mooncake.transfer.types import TransferOp


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


def send_kv(
    engine: TransferEngine,
    cache: PagedKVCache,
    src_prefix: str,
    src_block_ids: Sequence[int],
    num_tokens: int,
    dst_prefix: str,
    dst_endpoint: str,
    dst_block_ids: Sequence[int],
    remote_kv: Mapping[int, tuple[Tensor, Tensor]] | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Write the KV of `num_tokens` tokens (this cache's layers from `src_block_ids`, later
    stages' layers from `remote_kv`) into the decode node's `dst_block_ids`; returns bytes
    written; raises TransferError."""
    bt, nb = cache.block_tokens, -(-num_tokens // cache.block_tokens)
    assert len(dst_block_ids) >= nb and len(src_block_ids) >= nb, (nb, dst_block_ids)
    size = block_bytes(cache)
    token_bytes = size // bt
    reqs: list[TransferRequest] = []
    for layer in range(cache.first_layer, cache.end_layer):
        for half in ("k", "v"):
            src, dst = segment_name(src_prefix, layer, half), segment_name(dst_prefix, layer, half)
            remote = f"{dst}@{dst_endpoint}"
            for i in range(nb):
                n = min(bt, num_tokens - i * bt) * token_bytes
                reqs.append(TransferRequest(TransferOp.WRITE, src, src_block_ids[i] * size,
                                            remote, dst_block_ids[i] * size, n))  # fmt: skip
    temp: list[str] = []
    keep: list[Tensor] = []  # NOTE: registered memory must outlive the transfer
    try:
        for layer, pair in (remote_kv or {}).items():
            for half, t in zip(("k", "v"), pair, strict=True):
                name = f"{src_prefix}tmp.{half}{layer}"
                keep.append(t.contiguous())
                engine.register(name, keep[-1])
                temp.append(name)
                dst = f"{segment_name(dst_prefix, layer, half)}@{dst_endpoint}"
                for i in range(nb):
                    n = min(bt, num_tokens - i * bt) * token_bytes
                    reqs.append(TransferRequest(TransferOp.WRITE, name, i * bt * token_bytes,
                                                dst, dst_block_ids[i] * size, n))  # fmt: skip
        return engine.submit(reqs, timeout=timeout_s).check()
    finally:
        for name in temp:
            engine.unregister(name)
