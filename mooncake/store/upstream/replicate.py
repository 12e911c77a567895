"""Upstream's per-put settings: `ReplicateConfig`, `SoftPinAction`, `ObjectDataType`, with
upstream's fields and defaults (mooncake-store/include/replica.h, bound in
mooncake-integration/store/store_py.cpp), and `put_options`, what they mean to our Store.

    replica_num              -> replicas (copies on distinct nodes)
    soft_pin_action ENABLE   -> pin_ttl_s: soft_pin_ttl_ms, or upstream's default 30 min
    with_hard_pin            -> a pin of MAX_PIN_S: our pool evicts no pinned object
    preferred_segment(s), prefer_alloc_in_same_node, data_type, group_ids
                             -> accepted, no effect: our placement puts the first copy on
                                the writer's own segment when it has one
    nof_replica_num, dfs_replica_num > 0
                             -> refused (INVALID_PARAMS): no NVMe-oF or DFS pool here;
                                our lower tier is each node's SSD (store/node/tiers.py)
"""

from __future__ import annotations

import enum
from typing import Any, Final

SOFT_PIN_DEFAULT_S: Final = 30 * 60.0  # upstream's DEFAULT_KV_SOFT_PIN_TTL_MS (types.h)
MAX_PIN_S: Final = 86400 * 365.0  # the longest pin our master takes (store/server/messages.py)
MAX_REPLICAS: Final = 16


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin when it becomes readable."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """A label upstream keeps with an object; ours has no use for it."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """How a put stores its object; every field has upstream's default."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None  # None: the master's default
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""  # "host:port"; deprecated upstream for the list
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        # NOTE: upstream's binding takes an optional uint64; anything else is a TypeError
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64
        ):
            raise TypeError(
                f"soft_pin_ttl_ms: expected None or an int in [0, 2**64), got {value!r}"
            )
        self._soft_pin_ttl_ms = value

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
            f"nof_replica_num: {self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
            f"soft_pin_action: {SoftPinAction(self.soft_pin_action).name}, "
            f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(self.with_hard_pin)}, "
            f"preferred_segments: [{', '.join(self.preferred_segments)}], "
            f"preferred_segment: {self.preferred_segment}, "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)} }}"
        )

    __repr__ = __str__


def put_options(config: ReplicateConfig | None, overwrite: bool = False) -> dict[str, Any]:
    """The options of our Store's put for `config` (None: the defaults); raises ValueError
    naming the field when it asks for what this pool cannot do."""
    config = config or ReplicateConfig()
    if not isinstance(config, ReplicateConfig):
        raise ValueError(f"config: expected a ReplicateConfig, got {type(config).__name__}")
    if not 1 <= config.replica_num <= MAX_REPLICAS:
        raise ValueError(f"replica_num: expected 1..{MAX_REPLICAS}, got {config.replica_num}")
    if config.nof_replica_num or config.dfs_replica_num:
        raise ValueError(
            "nof_replica_num / dfs_replica_num: this pool has no NVMe-oF or DFS replicas "
            "(its lower tier is each store node's SSD); leave them 0"
        )
    action = SoftPinAction(config.soft_pin_action)
    ttl_ms = config.soft_pin_ttl_ms
    if ttl_ms is not None and action is not SoftPinAction.ENABLE:
        raise ValueError("soft_pin_ttl_ms: only valid with soft_pin_action = ENABLE")
    pin_s = 0.0
    if config.with_hard_pin:
        pin_s = MAX_PIN_S
    elif action is SoftPinAction.ENABLE:
        pin_s = SOFT_PIN_DEFAULT_S if ttl_ms is None else min(ttl_ms / 1000, MAX_PIN_S)
    return {"replicas": config.replica_num, "pin_ttl_s": pin_s, "overwrite": overwrite}
