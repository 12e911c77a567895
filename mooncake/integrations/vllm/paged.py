"""The worker's side of the vLLM connector: pool objects to and from vLLM's paged KV cache.

vLLM gives the connector one KV tensor per attention layer. A block's K and V of one layer
are one or two contiguous pieces of it, by the attention backend's layout:

    (num_blocks, kv_heads, block_tokens, 2 * head_dim)    vLLM CPU: one piece, K and V
                                                           interleaved per head
    (2, num_blocks, block_tokens, kv_heads, head_dim)      K piece, then V piece

A pool object (kv/object.py) holds layer l's pieces one after the other at
`k_offset(l)`; the model fingerprint names vLLM and its device, so these objects never
meet our engine's (whose layer bytes are laid out otherwise). Each layer tensor is
registered with the Transfer Engine, so bytes move between a replica and vLLM's blocks
with no copy (transfers.py moves them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from mooncake.errors import ConfigError
from mooncake.kv.object import KVLayout
from mooncake.store.client.client import Store
from mooncake.store.metadata.objects import ReplicaDesc
from mooncake.store.node.node import remote_name
from mooncake.transfer import TransferRequest
from mooncake.transfer.types import TransferOp


@dataclass(frozen=True)
class _LayerTensor:
    segment: str  # its Transfer Engine segment
    data: memoryview  # its bytes
    block_stride: int  # bytes from one block to the next
    pieces: tuple[tuple[int, int], ...]  # (offset from the block's start, bytes) per piece


class PagedCache:
    """vLLM's per-layer KV tensors, registered with `store`'s Transfer Engine."""

    def __init__(self, store: Store, layout: KVLayout, tensors: Sequence[torch.Tensor]):
        if len(tensors) != layout.num_layers:
            raise ConfigError(
                f"vLLM gave {len(tensors)} KV cache layers; the model has {layout.num_layers}"
            )
        self.store, self.layout = store, layout
        self.layers = [self._register(i, t) for i, t in enumerate(tensors)]

    def _register(self, index: int, t: torch.Tensor) -> _LayerTensor:
        lay, size = self.layout, t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ConfigError(
                f"KV cache layer {index}: {t.device} tensor of strides {t.stride()}; the "
                "connector moves KV straight from contiguous CPU caches only (vLLM for CPU)"
            )
        pieces: tuple[tuple[int, int], ...]
        if t[0].numel() * size == lay.layer_bytes:  # (num_blocks, ...): a block is one piece
            stride, pieces = t.stride(0) * size, ((0, lay.layer_bytes),)
        elif t.shape[0] == 2 and t[0, 0].numel() * size == lay.half_bytes:  # (2, blocks, ...)
            stride = t.stride(1) * size
            pieces = ((0, lay.half_bytes), (t.stride(0) * size, lay.half_bytes))
        else:
            raise ConfigError(
                f"KV cache layer {index} has shape {tuple(t.shape)}: not one of the layouts "
                f"the connector knows for {lay}"
            )
        flat = t.detach().view(-1).view(torch.uint8).numpy()
        segment = f"{self.store.node_id}.vllm-kv.{index}"
        self.store.register_buffer(segment, flat)
        return _LayerTensor(segment, flat.data, stride, pieces)

    def close(self) -> None:
        for layer in self.layers:
            self.store.unregister_buffer(layer.segment)

    def requests(
        self, op: TransferOp, layer: int, block_id: int, replica: ReplicaDesc
    ) -> list[TransferRequest]:
        """The transfers moving layer `layer` of block `block_id` to or from `replica`."""
        lt, remote = self.layers[layer], remote_name(replica.segment, replica.endpoint)
        base, at = block_id * lt.block_stride, replica.offset + self.layout.k_offset(layer)
        out = []
        for offset, length in lt.pieces:
            out.append(
                TransferRequest(op, lt.segment, base + offset, remote, at, length, replica.token)
            )
            at += length
        return out

    def digest(self, layer: int, block_id: int) -> int:
        """xxh3-64 of the layer's bytes of the block, pieces in order (kvobject's digest)."""
        lt = self.layers[layer]
        h, base = xxhash.xxh3_64(), block_id * lt.block_stride
        for offset, length in lt.pieces:
            h.update(lt.data[base + offset : base + offset + length])
        return h.intdigest()
