"""Mooncake Store: the KVCache pool over every node's VRAM, DRAM and SSD, by side.

- `metadata/`  the master's pure-logic metadata (`MetadataService` and its protocols)
- `server/`    the master side as a server (`StoreService`, wire messages, metrics)
- `client/`    the client (`Store`) and its data path
- `node/`      a node's tiers and the instructions it carries out

This package exports the metadata API and its result and event structs.
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
