"""Settings of a node: one TOML file, one frozen struct per section, validated as a whole.

Each field's `Annotated[..., knob(...)]` is the single source of truth for its meaning, unit,
allowed values and default: the loader (`mooncake.configload`) validates against it, and
`mooncake.toml.example` and `mooncake config show` are generated from it
(`mooncake.configdoc`). Runtime facts (hostname, detected GPUs and NICs) are not settings and
live in the topology's `NodeInfo`, never here.

    loaded = configload.load_config(Path("mooncake.toml"))  # defaults < file < env < flags
    loaded.config.store.replicas, loaded.sources["store.replicas"]   # 2, "env:MOONCAKE_..."
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mooncake.errors import ConfigError
from mooncake.rdmaconfig import RdmaConfig
from mooncake.sizes import Size

CONFIG_ENV = "MOONCAKE_CONFIG"  # environment variable naming the config file, if any


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
        str, knob('Node id, unique in the cluster; "" = hostname-role-pid-random, per process.')
    ] = ""
    advertise_address: Annotated[
        str, knob('Address peers use to reach this node; "" = auto-detected at runtime.')
    ] = ""
    port_range: Annotated[str, knob('Ports to listen on, "LOW-HIGH"; "" = any.', "portrange")] = ""


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
    copy_ahead_watermark: Annotated[
        float,
        knob(
            "Fill fraction of a tier past which its least recently used blocks are also "
            "copied to the tier below (DRAM -> SSD) ahead of eviction, so that eviction and "
            "a put into a full tier free memory at once; >= high_watermark: no copies ahead.",
            gt=0,
            le=1,
        ),
    ] = 0.5
    lease_ttl_s: Annotated[
        float, knob("Seconds a reader's lease pins a block against eviction.", gt=0)
    ] = 5.0
    heartbeat_ttl_s: Annotated[
        float, knob("Seconds without a heartbeat before the master drops a node.", gt=0)
    ] = 10.0


# NOTE: the rdma_* keys come from RdmaConfig (mooncake/rdmaconfig.py); flags spelled out for mypy
class TransferConfig(RdmaConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """[transfer]: the Transfer Engine."""

    protocol: Annotated[
        Literal["auto", "rdma", "tcp", "shm"],
        knob("Transport; auto: shm if the peer shares /dev/shm, else RDMA if usable, else TCP."),
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
    handshake_timeout_s: Annotated[
        float,
        knob(
            "Seconds a new connection to a transfer server or a pipeline stage has to "
            "finish the cluster-secret handshake, in all (a peer trickling bytes is cut "
            "off then).",
            gt=0,
        ),
    ] = 5.0
    max_handshakes_per_peer: Annotated[
        int,
        knob(
            "Connections from one address that may be in the handshake at once; more are "
            "refused until those finish (authenticated connections do not count).",
            ge=1,
        ),
    ] = 64


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
    stage_retry_s: Annotated[
        float,
        knob(
            "Longest pause between a pipeline leader's attempts to reach its next stage "
            "after the link broke (it asks the master where that stage is now, backing "
            "off from a tenth of this); its group takes no requests meanwhile.",
            gt=0,
        ),
    ] = 2.0
    stage_timeout_s: Annotated[
        float, knob("Leader's wait (s) per chunk on its next stage, then the task moves on.", gt=0)
    ] = 30.0
    max_inflight: Annotated[
        int,
        knob(
            "Requests in flight per prefill group: the first stage starts the next prompt "
            "while later stages finish this one, and KV streams out meanwhile.",
            ge=1,
        ),
    ] = 4
    reserve_timeout_s: Annotated[
        float,
        knob(
            "Wait (s) for room for a prompt's KV on its decode node before the prefill "
            "starts; past it the request fails, naming the full node.",
            gt=0,
        ),
    ] = 30.0


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
    drain_s: Annotated[
        float,
        knob(
            "Seconds a stopping decode node lets its running requests finish before it "
            "ends them with an error.",
            ge=0,
        ),
    ] = 30.0
    reserve_ttl_s: Annotated[
        float,
        knob(
            "Seconds blocks reserved for a prefill node's KV stay set aside without the "
            "request being submitted; then they are freed (its prefill node died or "
            "gave up).",
            gt=0,
        ),
    ] = 120.0
    max_step_failures: Annotated[
        int,
        knob(
            "Consecutive failed decode steps (each ends the requests of that step with "
            "an error) after which the node stops reporting ready and exits, for its "
            "supervisor to restart it.",
            ge=1,
        ),
    ] = 3
    stall_timeout_s: Annotated[
        float,
        knob(
            "Seconds one decode step may run before the node declares its step loop "
            "stuck, fails its requests and exits (for its supervisor to restart it).",
            gt=0,
        ),
    ] = 120.0


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
        str,
        knob(
            'Cost model from `mooncake profile`, a path on the master\'s machine; "" = '
            "analytic roofline of the model's shape on the GPUs of the first prefill node "
            "that reports known ones (until then the master's, else H800 x8)."
        ),
    ] = ""
    node_wait_s: Annotated[
        float,
        knob(
            "Seconds a request waits for a prefill group and a decode node when none can "
            "take it (a node restarting): a new request, or one whose node died and is "
            "placed again; then it fails (503). 0 = fail at once.",
            ge=0,
        ),
    ] = 60.0


class ApiConfig(msgspec.Struct, **_STRUCT):
    """[api]: the OpenAI-compatible HTTP front end (on the master)."""

    host: Annotated[str, knob("Address the HTTP API listens on.", min_length=1)] = "0.0.0.0"
    port: Annotated[int, knob("TCP port of the HTTP API.", ge=1, le=65535)] = 8000
    api_keys: Annotated[
        tuple[str, ...], knob("Bearer keys accepted by the API; empty = no auth.", "secret")
    ] = ()
    served_model_name: Annotated[
        str, knob("Model id clients name in requests and /v1/models; empty = model.path.")
    ] = ""


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
