"""Settings of the metadata service, and the rule for a valid object key."""

from __future__ import annotations

import msgspec

from mooncake.config.settings import StoreConfig
from mooncake.errors import ConfigError
from mooncake.store.metadata.allocator import Fit
from mooncake.store.metadata.objects import MAX_KEY_BYTES
from mooncake.store.metadata.placement import PlacementName


class MetadataConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Policies of the metadata service; `from_store_config` takes them from [store]."""

    replicas: int = 1  # copies per put when the put does not say
    # share of a memory tier's bytes that copies beyond a put's replicas may take
    replica_budget: float = 0.1
    lease_ttl_s: float = 5.0  # s a read protects an object
    heartbeat_ttl_s: float = 10.0  # s without a heartbeat before a node is dropped
    put_timeout_s: float = 30.0  # s before an unfinished put or tier move is reclaimed
    high_watermark: float = 0.95  # tier used share that starts eviction
    low_watermark: float = 0.85  # tier used share eviction brings it down to
    # tier used share past which the least recently used objects are copied to the tier
    # below ahead of eviction (kept here too), so eviction and a put at the high watermark
    # free memory at once; >= high_watermark: no copies ahead, victims demoted on eviction
    copy_ahead_watermark: float = 0.5
    placement: PlacementName = "local_first"
    seed: int = 0  # RNG seed of the random placement
    fit: Fit = "best"  # allocator fit
    promote_on_hit: bool = True  # a read of an SSD-only object moves it back to DRAM

    def __post_init__(self) -> None:
        errors = []
        if self.replicas < 1:
            errors.append(f"store.replicas must be >= 1, got {self.replicas}")
        if not 0 <= self.replica_budget <= 1:
            errors.append(f"store.replica_budget must be in [0, 1], got {self.replica_budget}")
        for name in ("lease_ttl_s", "heartbeat_ttl_s", "put_timeout_s"):
            if getattr(self, name) <= 0:
                errors.append(f"store.{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            errors.append(
                f"store.low_watermark ({self.low_watermark}) must be > 0 and below "
                f"store.high_watermark ({self.high_watermark}), which must be <= 1"
            )
        if not 0 < self.copy_ahead_watermark <= 1:
            errors.append(
                f"store.copy_ahead_watermark must be > 0 and <= 1, got {self.copy_ahead_watermark}"
            )
        if self.placement not in ("local_first", "free_ratio", "random"):
            errors.append(
                f"store placement must be local_first, free_ratio or random, got {self.placement!r}"
            )
        if self.fit not in ("best", "first"):
            errors.append(f'store allocator fit must be "best" or "first", got {self.fit!r}')
        if errors:
            raise ConfigError(errors)

    @classmethod
    def from_store_config(cls, store: StoreConfig, **overrides: object) -> MetadataConfig:
        fields = {
            "replicas": store.replicas,
            "replica_budget": store.replica_budget,
            "lease_ttl_s": store.lease_ttl_s,
            "heartbeat_ttl_s": store.heartbeat_ttl_s,
            "high_watermark": store.high_watermark,
            "low_watermark": store.low_watermark,
            "copy_ahead_watermark": store.copy_ahead_watermark,
        }
        return cls(**{**fields, **overrides})  # type: ignore[arg-type]


def key_error(key: str) -> str:
    """Why `key` is not a valid object key ("" if it is)."""
    if not key:
        return "an object key must not be empty"
    if key[0] == "\x00":
        return f"key {key[:40]!r} starts with NUL, which the store reserves for its own records"
    if len(key) * 4 > MAX_KEY_BYTES and len(key.encode()) > MAX_KEY_BYTES:
        return (
            f"key {key[:40]!r}... is {len(key.encode())} bytes, over the {MAX_KEY_BYTES}-byte "
            "limit; hash long names into a shorter key"
        )
    return ""
