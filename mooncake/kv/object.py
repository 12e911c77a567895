"""The KV object: one block's K and V for every layer, as stored in the pool.

Layout (little-endian; offsets in bytes, B = block_tokens, L = num_layers):

    0          header (HEADER, 76 bytes): magic "MCKV", version, dtype code, fingerprint,
               block hash, L, B, num_kv_heads, head_dim, payload offset, object bytes,
               checksum
    76         token ids: B x uint32
    76 + 4B    layer digests: L x uint64, xxh3-64 of layer l's K bytes then V bytes
    P          payload, P = the first multiple of 64 after the digests:
               layer l at P + l * layer_bytes: K (B, kv_heads, head_dim) then V, same shape

One layer's K and V are contiguous, so a writer fills layer l while layer l+1 computes and
a reader loads layer l into the paged cache before layer l runs. Version 2 (this one) lets
several writers fill one object in place: each pipeline stage writes its own layers into
the pool's replica and reports their digests (`layer_digest`), and whoever commits writes
the head (header, token ids, digests: `object_head`) last. The checksum is xxh3-64 of the
head after the header (token ids, digests, padding); each layer is checked against its
digest, so the object is covered end to end. The header fields are checked one by one
against what the reader expects. Torch-free: the Store validates objects too.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np
import xxhash

from mooncake.errors import StoreError
from mooncake.kv.hashing import as_token_array

MAGIC: Final = b"MCKV"
VERSION: Final = 2  # 1: one checksum over the whole object, written by one writer
HEADER = struct.Struct("<4sHH16s16sIIIIIQQ")
DTYPE_CODES: Final = {"float32": 1, "bfloat16": 2, "float16": 3}
DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
_ALIGN: Final = 64


class KVObjectError(StoreError):
    """A KV object is malformed, belongs to another model or block, or is corrupted.

    Readers treat it as a cache miss for this block and every later one (recompute).
    """


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of every KV object of one model and dtype."""

    num_layers: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16

    @property
    def half_bytes(self) -> int:
        """Bytes of the K (or the V) of one layer."""
        return self.block_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def layer_bytes(self) -> int:
        return 2 * self.half_bytes

    @property
    def digests_offset(self) -> int:
        return HEADER.size + 4 * self.block_tokens

    @property
    def payload_offset(self) -> int:
        end = self.digests_offset + 8 * self.num_layers
        return -(-end // _ALIGN) * _ALIGN

    @property
    def object_bytes(self) -> int:
        return self.payload_offset + self.num_layers * self.layer_bytes

    def k_offset(self, layer: int) -> int:
        return self.payload_offset + layer * self.layer_bytes

    def v_offset(self, layer: int) -> int:
        return self.k_offset(layer) + self.half_bytes


class KVObjectBuilder:
    """A KV object being written layer by layer (put-start .. put-end), in `buf`."""

    def __init__(
        self, layout: KVLayout, fingerprint: bytes, block_hash: int, token_ids: Sequence[int]
    ):
        tokens = as_token_array(token_ids)
        assert tokens.size == layout.block_tokens, (tokens.size, layout.block_tokens)
        self.layout, self.fingerprint = layout, fingerprint
        self.block_hash, self.tokens = block_hash, tokens
        self.buf = bytearray(layout.object_bytes)
        self._missing = set(range(layout.num_layers))

    def set_layer(self, layer: int, k: bytes | memoryview, v: bytes | memoryview) -> None:
        """Copy one layer's K and V bytes in (writers with tensors copy into `buf` directly
        and call `mark_written`)."""
        lay = self.layout
        self.buf[lay.k_offset(layer) : lay.k_offset(layer) + lay.half_bytes] = k
        self.buf[lay.v_offset(layer) : lay.v_offset(layer) + lay.half_bytes] = v
        self.mark_written(layer)

    def mark_written(self, layer: int) -> None:
        self._missing.discard(layer)

    @property
    def is_complete(self) -> bool:
        """Every layer written (by one writer or several)."""
        return not self._missing

    def commit(self) -> bytearray:
        """Seal the object: every layer written, checksum set. Returns the object bytes."""
        if self._missing:
            raise KVObjectError(
                f"KV object {self.block_hash:032x} committed without layers {sorted(self._missing)}"
            )
        lay, view = self.layout, memoryview(self.buf)
        digests = [
            xxhash.xxh3_64_intdigest(view[lay.k_offset(i) : lay.k_offset(i) + lay.layer_bytes])
            for i in range(lay.num_layers)
        ]
        head = object_head(lay, self.fingerprint, self.block_hash, self.tokens, digests)
        self.buf[: len(head)] = head
        return self.buf


def layer_digest(k: bytes | memoryview, v: bytes | memoryview) -> int:
    """The digest of one layer of one block: xxh3-64 of its K bytes then its V bytes."""
    h = xxhash.xxh3_64(k)
    h.update(v)
    return h.intdigest()


def object_head(
    layout: KVLayout,
    fingerprint: bytes,
    block_hash: int,
    token_ids: Sequence[int] | np.ndarray,
    digests: Sequence[int],
) -> bytearray:
    """The first `payload_offset` bytes of an object whose layer l has digest digests[l]:
    what seals an object written layer by layer in place."""
    tokens = as_token_array(token_ids)
    assert tokens.size == layout.block_tokens and len(digests) == layout.num_layers
    head = bytearray(layout.payload_offset)
    off = layout.digests_offset
    head[HEADER.size : off] = tokens.tobytes()
    head[off : off + 8 * len(digests)] = np.asarray(digests, dtype="<u8").tobytes()
    checksum = xxhash.xxh3_64_intdigest(memoryview(head)[HEADER.size :])
    HEADER.pack_into(
        head,
        0,
        MAGIC,
        VERSION,
        DTYPE_CODES[layout.dtype],
        fingerprint,
        block_hash.to_bytes(16, "little"),
        layout.num_layers,
        layout.block_tokens,
        layout.num_kv_heads,
        layout.head_dim,
        layout.payload_offset,
        layout.object_bytes,
        checksum,
    )
    return head


@dataclass(frozen=True)
class KVObjectView:
    """A validated KV object: `data` sliced with the layout's offsets gives each layer."""

    layout: KVLayout
    block_hash: int
    token_ids: np.ndarray  # (block_tokens,) uint32
    data: memoryview  # the whole object


def encode_kv_object(
    layout: KVLayout,
    fingerprint: bytes,
    block_hash: int,
    token_ids: Sequence[int],
    layers: Sequence[tuple[bytes | memoryview, bytes | memoryview]],
) -> bytearray:
    """A committed object from every layer's (K bytes, V bytes)."""
    builder = KVObjectBuilder(layout, fingerprint, block_hash, token_ids)
    for i, (k, v) in enumerate(layers):
        builder.set_layer(i, k, v)
    return builder.commit()


def decode_kv_head(
    data: bytes | bytearray | memoryview,
    layout: KVLayout,
    fingerprint: bytes,
    *,
    block_hash: int | None = None,
    token_ids: Sequence[int] | np.ndarray | None = None,
    verify_checksum: bool = True,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Validate an object's head (its first `payload_offset` bytes, or more) against what the
    reader expects; returns (block hash, token ids, layer digests) without touching a layer,
    for a reader that lands each layer elsewhere and checks it against its digest. Raises
    KVObjectError if any header field, the block hash, the token ids or the checksum differ."""
    view = memoryview(data).cast("B")
    name = f"{block_hash:032x}" if block_hash is not None else "KV object"
    if len(view) < HEADER.size:
        raise KVObjectError(f"{name}: {len(view)} bytes is shorter than a KV object header")
    magic, version, dtype, fp, bh, nl, bt, kvh, hd, poff, size, checksum = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise KVObjectError(
            f"{name}: not a version-{VERSION} KV object (magic {magic!r}, v{version})"
        )
    if fp != fingerprint:
        raise KVObjectError(f"{name}: written by another model or dtype (fingerprint differs)")
    got = (nl, bt, kvh, hd, dtype, poff, size)
    want = (
        layout.num_layers,
        layout.block_tokens,
        layout.num_kv_heads,
        layout.head_dim,
        DTYPE_CODES[layout.dtype],
        layout.payload_offset,
        layout.object_bytes,
    )
    if got != want:
        raise KVObjectError(f"{name}: header shapes {got} differ from the expected {want}")
    if len(view) < poff:
        raise KVObjectError(f"{name}: {len(view)} bytes is shorter than its head ({poff})")
    found_hash = int.from_bytes(bh, "little")
    if block_hash is not None and found_hash != block_hash:
        raise KVObjectError(f"{name}: holds block {found_hash:032x} instead")
    stored = np.frombuffer(view, dtype="<u4", count=bt, offset=HEADER.size)
    if token_ids is not None and not np.array_equal(stored, as_token_array(token_ids)):
        first = int(np.argmax(stored != as_token_array(token_ids)))
        raise KVObjectError(f"{name}: token ids differ from the prompt's at offset {first}")
    if verify_checksum and xxhash.xxh3_64_intdigest(view[HEADER.size : poff]) != checksum:
        raise KVObjectError(f"{name}: checksum mismatch (corrupted in memory or transfer)")
    digests = np.frombuffer(view, dtype="<u8", count=nl, offset=layout.digests_offset)
    return found_hash, stored, digests


def decode_kv_object(
    data: bytes | bytearray | memoryview,
    layout: KVLayout,
    fingerprint: bytes,
    *,
    block_hash: int | None = None,
    token_ids: Sequence[int] | np.ndarray | None = None,
    verify_checksum: bool = True,
) -> KVObjectView:
    """Validate an object against what the reader expects; raises KVObjectError if any
    header field, the block hash, the token ids or the checksum differ. No copy."""
    view = memoryview(data).cast("B")
    found_hash, stored, digests = decode_kv_head(
        view,
        layout,
        fingerprint,
        block_hash=block_hash,
        token_ids=token_ids,
        verify_checksum=verify_checksum,
    )
    name = f"{found_hash:032x}"
    if len(view) != layout.object_bytes:
        raise KVObjectError(f"{name}: {len(view)} bytes, header says {layout.object_bytes}")
    if verify_checksum:
        for i in range(layout.num_layers):
            lo = layout.k_offset(i)
            if xxhash.xxh3_64_intdigest(view[lo : lo + layout.layer_bytes]) != int(digests[i]):
                raise KVObjectError(
                    f"{name}: layer {i} does not match its digest (corrupted in memory or "
                    "transfer, or a writer did not finish it)"
                )
    return KVObjectView(layout=layout, block_hash=found_hash, token_ids=stored, data=view)
