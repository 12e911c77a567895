"""vLLM's KV event wire format (`vllm/distributed/kv_events.py`), written and read here.

A publisher sends each `KVEventBatch` as three ZeroMQ frames on a PUB socket:

    | frame | content                                               |
    |-------|-------------------------------------------------------|
    | 0     | topic (UTF-8; "" = none)                              |
    | 1     | sequence number, 8 bytes big-endian, +1 per batch     |
    | 2     | msgpack of the batch                                  |

The batch is a msgpack array `[ts, events, data_parallel_rank]` (msgspec `array_like`,
the rank omitted when None). Each event is tagged by its class name; vLLM has used two
encodings of an event, and a reader here accepts both:

- a map with a `type` key: `{"type": "BlockStored", "block_hashes": [...], ...}` (vLLM
  >= 0.11, and what `encode_batch` writes, byte for byte as vLLM 0.32 does: fields in
  declaration order, the ones with a default left out while they hold it);
- a positional array with the tag first: `["BlockStored", block_hashes, parent, ...]`
  (vLLM 0.8 to 0.10, when the event classes were `array_like` too).

A replay request on the ROUTER socket is `[b"", start_seq (8 bytes big-endian)]` from a
DEALER (a REQ adds the empty frame itself); the answer is every buffered batch from
`start_seq` on, as `[b"", topic, seq, payload]`, then `[b"", b"", END_SEQ, b""]`.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)  # the replay's last reply
# vLLM's `medium` values (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE), and our tiers' names in them
MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
TIER_TO_MEDIUM: Final = {"vram": MEDIUM_GPU, "dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE}
MEDIUM_TO_TIER: Final = {m: t for t, m in TIER_TO_MEDIUM.items()}

BlockHash = bytes | int  # vLLM's ExternalBlockHash: 32 bytes of sha256, or a 64-bit int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks now cached: `token_ids` are all of theirs (len = blocks x block_size), the
    first chained from `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int  # tokens per block
    lora_id: int | None
    medium: str | None  # where: "GPU", "CPU", "STORAGE" (None: the publisher's GPU)
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block; salt, mm, lora
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" / "REMOTE" relative to the publisher
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks no longer cached in `medium`."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every block of the publisher (of this data_parallel_rank) is gone."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[Event]
    data_parallel_rank: int | None = None  # which engine (here: which pool node) it is about


# What a reader accepts: every field past the required ones optional (older vLLMs wrote
# fewer), as a map (vLLM >= 0.11) or as an array with the tag first (vLLM 0.8-0.10)
class _InBlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _InBlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _InAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _ArrayBlockStored(_InBlockStored, tag="BlockStored", array_like=True):
    pass


class _ArrayBlockRemoved(_InBlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _ArrayAllBlocksCleared(_InAllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


_MapEvent = _InBlockStored | _InBlockRemoved | _InAllBlocksCleared
_ArrayEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
_CANONICAL: dict[str, type[Event]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_encoder = msgspec.msgpack.Encoder()


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]  # decoded one by one: either encoding
    data_parallel_rank: int | None = None


_raw_batch = msgspec.msgpack.Decoder(_RawBatch)


class WireError(ValueError):
    """A payload that is not a vLLM KV event batch (the reason says which part)."""


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch's msgpack payload, as vLLM's ZmqEventPublisher encodes it."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from either event encoding (module docstring); raises WireError."""
    try:
        raw = _raw_batch.decode(payload)
        events = [_decode_event(e) for e in raw.events]
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not a vLLM KVEventBatch: {e}") from e
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


def _decode_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        event: Any = msgspec.convert(raw, _MapEvent)
    elif isinstance(raw, list):
        event = msgspec.convert(raw, _ArrayEvent)
    else:
        raise msgspec.ValidationError(f"an event is a map or an array, not {type(raw).__name__}")
    cls = _CANONICAL[type(event).__struct_config__.tag]
    return cls(**msgspec.structs.asdict(event))


def seq_bytes(seq: int) -> bytes:
    """A sequence number's frame."""
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """A sequence number from its frame (-1: the replay's end marker)."""
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
