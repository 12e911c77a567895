"""Mooncake Store: the KVCache pool over every node's VRAM, DRAM and SSD, by side.

- `metadata/`  the master's pure-logic metadata (`MetadataService` and its protocols)
- `server/`    the master side as a server (`StoreService`, wire messages, metrics)
- `client/`    the client (`Store`) and its data path
- `node/`      a node's tiers and the instructions it carries out
- `upstream/`  upstream Mooncake's Python Store API (`MooncakeDistributedStore`) over ours

This package exports the metadata API and its result and event structs, and (imported on
first use, as `from mooncake.store import MooncakeDistributedStore`) upstream's names.
"""

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    """Upstream's names (store/upstream/__init__.py `__all__`), imported on first use."""
    upstream = importlib.import_module("mooncake.store.upstream")
    if name in upstream.__all__:
        return getattr(upstream, name)
    raise AttributeError(f"module 'mooncake.store' has no attribute {name!r}")


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
