"""Mooncake Store: the KVCache pool over every node's VRAM, DRAM and SSD.

Modules
-------
- `allocator`: offset allocator of one segment (aligned, best or first fit, coalescing).
- `objects`: records (segments, objects, replicas) and the structs that cross boundaries.
- `settings`: `MetadataConfig` and the object key rule.
- `segments`: nodes, mounted segments, per-tier byte totals, replica allocation.
- `placement`: replica placement strategies (local_first, free_ratio, random).
- `metadata`: `MetadataService`, the master's pure-logic metadata (put/get/remove/pin...).
- `eviction`: watermark eviction, copies ahead to SSD, room made at once for a put.
- `moves`: tier moves in flight (demote, copy ahead, promote on a hit, replicate).
- `membership`: node expiry and segment loss.
- `audit`: stats snapshot and integrity check.
- `messages`: the `*Msg` wire structs and `handle()` that serves them from the service.
"""

from mooncake.store.metadata.objects import (
    GetResult,
    Instruction,
    KeyResult,
    PutStartResult,
    ReplicaDesc,
    StoreEvent,
    StoreStats,
)
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.settings import MetadataConfig

__all__ = [
    "GetResult",
    "Instruction",
    "KeyResult",
    "MetadataConfig",
    "MetadataService",
    "PutStartResult",
    "ReplicaDesc",
    "StoreEvent",
    "StoreStats",
]
