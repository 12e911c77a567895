"""Settings of a node: one TOML file, one frozen struct per section, validated as a whole.

Each field's `Annotated[..., knob(...)]` is the single source of truth for its meaning, unit,
allowed values and default: the loader (`mooncake.configload`) validates against it, and
`mooncake.toml.example` and `mooncake config show` are generated from it
(`mooncake.configdoc`). Runtime facts (hostname, detected GPUs and NICs) are not settings and
live in the topology's `NodeInfo`, never here.

    loaded = load_config(Path("mooncake.toml"))       # defaults < file < MOONCAKE_* < flags
    loaded.config.store.replicas, loaded.sources["store.replicas"]   # 2, "env:MOONCAKE_..."
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mooncake.errors import ConfigError

# unit (lower-case) -> bytes; bare K/M/G/T are binary, as `ls -h` and most tools read them
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[f"{_p}b"] = 1000**_i
    _UNITS[f"{_p}ib"] = _UNITS[_p] = 1024**_i
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")
SIZE_HELP = 'bytes as an integer or with a unit: "4096", "512MB", "64KiB", "1.5TiB"'
CONFIG_ENV = "MOONCAKE_CONFIG"  # environment variable naming the config file, if any


def parse_size(text: str | int) -> int:
    """Bytes in `text`: an integer or a number with a unit (B, KB/MB/GB/TB = powers of 1000,
    KiB/MiB/GiB/TiB and bare K/M/G/T = powers of 1024; case-insensitive; decimals allowed and
    rounded down to whole bytes). Raises ConfigError on anything else, including negatives."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"expected a size >= 0, got {text}")
        return text
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}")
    try:
        return int(Decimal(m.group(1)) * _UNITS[unit])
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise ConfigError(f"expected a size ({SIZE_HELP}), got {text!r}") from e


def format_size(num_bytes: int) -> str:
    """Shortest exact spelling of `num_bytes`: "64KiB", "512MB", "1000" (parse_size inverts it)."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB", "PB", "TB", "GB", "MB", "KB"):
        scale = _UNITS[unit.lower()]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


class Size(msgspec.Struct, frozen=True):
    """A memory budget: absolute bytes, or a share of the free bytes the topology reports."""

    num_bytes: int = 0  # bytes; used when fraction is None
    fraction: float | None = None  # share of free bytes in [0, 1] ("80%" -> 0.8), or None

    @classmethod
    def parse(cls, text: str | int) -> Size:
        """A Size from `text` ("80%", "64GiB", 4096); raises ConfigError when malformed."""
        if isinstance(text, str) and "%" in text:
            m = _PERCENT_RE.match(text)
            if m is None or Decimal(m.group(1)) > 100:
                raise ConfigError(
                    f'expected a percentage of free memory in 0%..100% like "80%", got {text!r}'
                )
            return cls(fraction=float(Decimal(m.group(1)) / 100))
        return cls(num_bytes=parse_size(text))

    @property
    def is_zero(self) -> bool:
        """True when this tier is disabled (0 bytes or 0%)."""
        return not self.fraction and self.num_bytes == 0

    def resolve(self, free_bytes: int) -> int:
        """Bytes to use on a node whose topology reports `free_bytes` free (pure, no I/O)."""
        if self.fraction is None:
            return self.num_bytes
        return int(free_bytes * self.fraction)

    def __str__(self) -> str:
        if self.fraction is None:
            return format_size(self.num_bytes)
        return f"{self.fraction * 100:g}%"


def knob(doc: str, kind: str = "", **constraints: Any) -> Meta:
    """Field metadata: `doc` (meaning, unit) plus msgspec constraints (ge, le, gt, pattern...).
    `kind` marks types TOML cannot say: "size" (Size), "bytes" (int from a size string),
    "hostport", "secret" (never printed)."""
    return Meta(description=doc, extra={"kind": kind} if kind else None, **constraints)


_STRUCT = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}
Role = Literal["master", "prefill", "decode", "store"]


class ClusterConfig(msgspec.Struct, **_STRUCT):
    """[cluster]: what every node of one cluster shares."""

    name: Annotated[
        str, knob("Cluster name: lower-case letters, digits and '-'.", pattern="^[a-z0-9-]+$")
    ] = "mooncake"
    master: Annotated[
        str, knob("host:port of the master's control plane; every node dials it.", "hostport")
    ] = "127.0.0.1:50051"
    secret: Annotated[
        str,
        knob(
            "Cluster secret every node must share (>= 16 characters). Empty is allowed here "
            "but multi-node roles refuse to start without a secret or secret_file.",
            "secret",
        ),
    ] = ""
    secret_file: Annotated[
        str, knob("Path of a file holding the cluster secret; use instead of secret.")
    ] = ""

    def require_secret(self) -> str:
        """The cluster secret (from `secret` or `secret_file`); raises ConfigError if none.

        Reads `secret_file` (surrounding whitespace stripped); does not change state.
        """
        if self.secret:
            return self.secret
        if not self.secret_file:
            raise ConfigError(
                "cluster.secret: a multi-node cluster needs a shared secret; set cluster.secret "
                "(>= 16 characters), cluster.secret_file or MOONCAKE_CLUSTER_SECRET"
            )
        try:
            secret = Path(self.secret_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cluster.secret_file: cannot read {self.secret_file}: {e}") from e
        if len(secret) < MIN_SECRET_LEN:
            raise ConfigError(
                f"cluster.secret_file: {self.secret_file} holds {len(secret)} characters, "
                f"expected at least {MIN_SECRET_LEN}"
            )
        return secret


MIN_SECRET_LEN = 16  # characters of a cluster secret


class NodeConfig(msgspec.Struct, **_STRUCT):
    """[node]: what this process is."""

    role: Annotated[Role, knob("What this process runs.")] = "master"
    id: Annotated[
        str, knob('Node id, unique in the cluster; "" = derived at runtime from hostname+role.')
    ] = ""
    advertise_address: Annotated[
        str, knob('Address peers use to reach this node; "" = auto-detected at runtime.')
    ] = ""


_TIER = "bytes, or a percentage of what the topology reports free; 0 disables the tier"


class StoreConfig(msgspec.Struct, **_STRUCT):
    """[store]: this node's share of the KVCache pool and the pool's policies."""

    vram_bytes: Annotated[Size, knob(f"GPU memory this node gives the pool: {_TIER}.", "size")] = (
        Size()
    )
    dram_bytes: Annotated[Size, knob(f"Host DRAM this node gives the pool: {_TIER}.", "size")] = (
        Size(fraction=0.5)
    )
    ssd_bytes: Annotated[Size, knob(f"SSD space this node gives the pool: {_TIER}.", "size")] = (
        Size()
    )
    ssd_path: Annotated[
        str, knob("Directory for the SSD tier; required when ssd_bytes is not 0.")
    ] = ""
    replicas: Annotated[int, knob("Copies of each KV block kept in the pool.", ge=1)] = 1
    high_watermark: Annotated[
        float, knob("Pool fill fraction at which eviction starts.", gt=0, le=1)
    ] = 0.95
    low_watermark: Annotated[
        float, knob("Fill fraction eviction brings the pool down to; < high_watermark.", gt=0, le=1)
    ] = 0.85
    lease_ttl_s: Annotated[
        float, knob("Seconds a reader's lease pins a block against eviction.", gt=0)
    ] = 5.0
    heartbeat_ttl_s: Annotated[
        float, knob("Seconds without a heartbeat before the master drops a node.", gt=0)
    ] = 10.0


class TransferConfig(msgspec.Struct, **_STRUCT):
    """[transfer]: the Transfer Engine."""

    protocol: Annotated[
        Literal["auto", "rdma", "tcp", "shm"],
        knob("Transport; auto = RDMA if a NIC is usable, shm on the same host, else TCP."),
    ] = "auto"
    nics: Annotated[
        tuple[str, ...],
        knob("NIC names allowed for transfers (e.g. mlx5_0); empty = all detected."),
    ] = ()
    slice_bytes: Annotated[
        int, knob("Bytes per transfer slice (a size without %).", "bytes", ge=4096)
    ] = 65536
    connections_per_peer: Annotated[
        int, knob("Connections (or RDMA queue pairs) opened to each peer.", ge=1, le=64)
    ] = 4
    retry_budget: Annotated[int, knob("Retries of a failed slice, on other paths.", ge=0)] = 3
    timeout_s: Annotated[float, knob("Seconds before a transfer is declared failed.", gt=0)] = 10.0
    spin_us: Annotated[
        float,
        knob(
            "Microseconds a thread waiting for a small reply (a Store call, a TCP slice) polls "
            "before it sleeps; a wake-up costs tens of microseconds on a VM. 0 = sleep at "
            "once.",
            ge=0,
            le=10000,
        ),
    ] = 200.0


class ModelConfig(msgspec.Struct, **_STRUCT):
    """[model]: the model every prefill and decode node serves."""

    path: Annotated[
        str,
        knob('A local model directory, or "dummy:NAME" for a built-in test model.', "modelpath"),
    ] = "dummy:tiny"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        knob("Weight and KV dtype; auto = the model's own."),
    ] = "auto"
    block_tokens: Annotated[
        int,
        knob(
            "Tokens per KV block, the prefix-hashing unit (public traces use 512).", ge=1, le=65536
        ),
    ] = 512
    max_model_len: Annotated[
        int, knob("Longest prompt+output in tokens; 0 = from the model.", ge=0)
    ] = 0


class PrefillConfig(msgspec.Struct, **_STRUCT):
    """[prefill]: prefill nodes."""

    chunk_tokens: Annotated[int, knob("Tokens per prefill chunk.", ge=1)] = 1024
    pipeline_group_size: Annotated[
        int, knob("Nodes per chunked pipeline-parallel prefill group; 0 = automatic.", ge=0)
    ] = 1
    kv_cache_bytes: Annotated[
        Size,
        knob("Device memory for the paged KV cache of prompts being prefilled: bytes, or a "
             "percentage of the free GPU (CPU: available) memory.", "size"),
    ] = Size(num_bytes=1 << 30)  # fmt: skip


class DecodeConfig(msgspec.Struct, **_STRUCT):
    """[decode]: decode nodes."""

    max_batch: Annotated[int, knob("Most requests decoded together in one step.", ge=1)] = 128
    max_tokens_default: Annotated[
        int, knob("Output tokens when a request does not say max_tokens.", ge=1)
    ] = 256
    kv_cache_bytes: Annotated[
        Size,
        knob("Device memory for the paged KV cache of decoding requests: bytes, or a "
             "percentage of the free GPU (CPU: available) memory.", "size"),
    ] = Size(num_bytes=2 << 30)  # fmt: skip


class SchedulerConfig(msgspec.Struct, **_STRUCT):
    """[scheduler]: the Conductor (paper Algorithm 1)."""

    policy: Annotated[
        Literal["random", "load_balance", "cache_aware", "kvcache_centric"],
        knob("How the Conductor picks prefill and decode instances."),
    ] = "kvcache_centric"
    ttft_slo_s: Annotated[float, knob("Time-to-first-token SLO, seconds.", gt=0)] = 30.0
    tbt_slo_s: Annotated[float, knob("Time-between-tokens SLO, seconds.", gt=0)] = 0.1
    balancing_threshold: Annotated[
        float,
        knob(
            "Algorithm 1's kvcache_balancing_threshold: a prefill node fetches a longer prefix "
            "from another node only if best_prefix_len / its own prefix_len reaches this ratio, "
            "else it recomputes.",
            ge=1.0,
        ),
    ] = 1.5
    rejection: Annotated[
        Literal["none", "basic", "predictive"],
        knob(
            "Early rejection under overload: none; basic (reject on the current max of "
            "TTFT/SLO and TBT/SLO); predictive (on the decode load predicted for when the "
            "request's prefill ends, which avoids load oscillation)."
        ),
    ] = "predictive"
    forecast_sigmas: Annotated[
        float,
        knob(
            "Predictive rejection at arrival waits for the predicted decode load to exceed 1 "
            "by this many standard deviations of the forecast's own measured error.",
            ge=0,
        ),
    ] = 2.0
    cost_model_path: Annotated[
        str, knob('Cost model written by `mooncake profile`; "" = analytic roofline.')
    ] = ""


class ApiConfig(msgspec.Struct, **_STRUCT):
    """[api]: the OpenAI-compatible HTTP front end (on the master)."""

    host: Annotated[str, knob("Address the HTTP API listens on.", min_length=1)] = "0.0.0.0"
    port: Annotated[int, knob("TCP port of the HTTP API.", ge=1, le=65535)] = 8000
    api_keys: Annotated[
        tuple[str, ...], knob("Bearer keys accepted by the API; empty = no auth.", "secret")
    ] = ()


class MetricsConfig(msgspec.Struct, **_STRUCT):
    """[metrics]: the Prometheus endpoint."""

    enabled: Annotated[bool, knob("Serve Prometheus metrics at /metrics.")] = True
    host: Annotated[str, knob("Address the metrics endpoint listens on.", min_length=1)] = "0.0.0.0"
    port: Annotated[
        int, knob("TCP port of /metrics; 0 = serve /metrics on the api port.", ge=0, le=65535)
    ] = 9400


class Config(msgspec.Struct, **_STRUCT):
    """All settings of one node; `Config()` is the documented defaults."""

    cluster: ClusterConfig = ClusterConfig()
    node: NodeConfig = NodeConfig()
    store: StoreConfig = StoreConfig()
    transfer: TransferConfig = TransferConfig()
    model: ModelConfig = ModelConfig()
    prefill: PrefillConfig = PrefillConfig()
    decode: DecodeConfig = DecodeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    api: ApiConfig = ApiConfig()
    metrics: MetricsConfig = MetricsConfig()


class LoadedConfig(msgspec.Struct, frozen=True):
    """A validated Config and where each value came from."""

    config: Config
    sources: dict[str, str]  # "store.replicas" -> "default" | "file:PATH" | "env:VAR" | "flag"


def load_config(
    path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> LoadedConfig:
    """Defaults < TOML file at `path` < `MOONCAKE_<SECTION>_<KEY>` in `env` (None = os.environ)
    < `overrides` (dotted keys, typed or string values, e.g. from --set). Reads the file; raises
    ConfigError listing every problem found."""
    from mooncake.configload import load

    return load(path, env, overrides)


def parse_set_option(text: str) -> tuple[str, str]:
    """("store.replicas", "2") from a `--set store.replicas=2` flag; ConfigError if malformed."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or key.count(".") != 1 or not all(key.split(".")):
        raise ConfigError(f"--set {text}: expected SECTION.KEY=VALUE, e.g. store.replicas=2")
    return key, value.strip()
