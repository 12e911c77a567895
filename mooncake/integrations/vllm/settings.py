"""The connector's settings: the pool from a mooncake TOML file, the model's KV layout
and fingerprint from vLLM's config (passed in as plain values: no vLLM import here).

`kv_connector_extra_config` keys: `config` (path of the TOML file; absent: defaults and
`MOONCAKE_*` variables only). From the file: `cluster.master`/`masters` and the secret
name the pool, `cluster.store_call_timeout_s` bounds every Store call and transfer batch,
`store.replicas` sets the copies of each stored block, `[transfer]` the Transfer Engine,
`node.advertise_address` the address the store nodes reach this process at.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake.config.load import load_config
from mooncake.config.portrange import node_ports
from mooncake.errors import ConfigError
from mooncake.kv.hashing import model_fingerprint
from mooncake.kv.object import DTYPE_BYTES, KVLayout
from mooncake.roles.node.common import default_host, masters_to_dial
from mooncake.store.client.client import Store
from mooncake.transfer.types import EngineOptions

EXTRA_KEYS = ("config",)


@dataclass(frozen=True)
class ConnectorSettings:
    """Where the pool is and how this process talks to it."""

    master: str  # "tcp://host:port", comma-separated when several masters
    secret: bytes
    timeout_s: float  # seconds per Store call and per transfer batch
    replicas: int  # copies of each stored block
    host: str  # address of this process's Transfer Engine server
    engine_options: EngineOptions
    put_wait_s: float = 5.0  # s a put waits for room on its way ([store] put_wait_s)
    put_retry_s: float = 0.01  # s between its asks ([store] put_retry_s)


def load_settings(extra: Mapping[str, Any]) -> ConnectorSettings:
    """Settings from `kv_connector_extra_config`; raises ConfigError naming a bad key or
    what the TOML file lacks."""
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown keys {unknown}; allowed: {list(EXTRA_KEYS)}"
        )
    path = extra.get("config")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"kv_connector_extra_config.config: a TOML file path, got {path!r}")
    config = load_config(path).config
    masters = masters_to_dial(config)
    return ConnectorSettings(
        master=",".join(f"tcp://{m}" for m in masters),
        secret=config.cluster.require_secret().encode(),
        timeout_s=config.cluster.store_call_timeout_s,
        replicas=config.store.replicas,
        host=config.node.advertise_address or default_host(config.cluster.master),
        engine_options=EngineOptions.from_config(config.transfer, ports=node_ports(config)),
        put_wait_s=config.store.put_wait_s,
        put_retry_s=config.store.put_retry_s,
    )


def connect(settings: ConnectorSettings, role: str) -> Store:
    """A Store client of its own for one side of the connector ("scheduler", "worker")."""
    return Store.connect(
        settings.master,
        settings.secret,
        node_id=f"vllm-{role}-{uuid.uuid4().hex[:8]}",
        host=settings.host,
        timeout_s=settings.timeout_s,
        engine_options=settings.engine_options,
        put_wait_s=settings.put_wait_s,
        put_retry_s=settings.put_retry_s,
    )


def kv_layout(
    num_layers: int, block_tokens: int, num_kv_heads: int, head_dim: int, dtype: str
) -> KVLayout:
    """The pool object layout of one vLLM block; raises ConfigError for a KV cache dtype
    the pool has no code for (vLLM's fp8 caches)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(
            f"KV cache dtype {dtype!r} is not supported by the pool; use one of "
            f"{sorted(DTYPE_BYTES)} (vLLM --dtype / --kv-cache-dtype auto)"
        )
    return KVLayout(num_layers, block_tokens, num_kv_heads, head_dim, dtype)


def vllm_fingerprint(model: str, device: str, layout: KVLayout) -> bytes:
    """The model fingerprint of vLLM's KV on `device` ("cpu", "cuda"): part of every block
    hash and object header, so vLLM's blocks (laid out as its attention backend does on
    that device) never meet our engine's or another device's."""
    name = f"vllm:{device}:{model}"
    return model_fingerprint(
        name, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype
    )
