"""Settings of a node: one TOML file, one frozen struct per section, validated as a whole.

Each field's `Annotated[..., knob(...)]` is the single source of truth for its meaning, unit,
allowed values and default: the loader (`mooncake.config.load`) validates against it, and
`mooncake.toml.example` and `mooncake config show` are generated from it
(`mooncake.config.doc`). Runtime facts (hostname, detected GPUs and NICs) are not settings and
live in the topology's `NodeInfo`, never here.

    loaded = configload.load_config(Path("mooncake.toml"))  # defaults < file < env < flags
    loaded.config.store.replicas, loaded.sources["store.replicas"]   # 2, "env:MOONCAKE_..."
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from mooncake.config.api import ApiConfig
from mooncake.config.etcd import EtcdConfig
from mooncake.config.knob import STRUCT as _STRUCT
from mooncake.config.knob import knob
from mooncake.config.rdma import RdmaConfig
from mooncake.config.roles import DecodeConfig, PrefillConfig, SchedulerConfig
from mooncake.config.router import KvEventsConfig, RouterConfig
from mooncake.config.sizes import Size
from mooncake.errors import ConfigError

CONFIG_ENV = "MOONCAKE_CONFIG"  # environment variable naming the config file, if any


Role = Literal["master", "prefill", "decode", "store"]


# NOTE: the etcd keys come from EtcdConfig (mooncake/config/etcd.py); flags spelled out for mypy
class ClusterConfig(EtcdConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
    call_timeout_s: Annotated[
        float,
        knob(
            "Seconds the master or a node waits for the answer to one control-plane call "
            "(registration, heartbeat, a prefill task, a batch of tokens, a prefill report) "
            "before it counts as lost: the caller then retries, re-sends or gives up.",
            gt=0,
        ),
    ] = 5.0
    heartbeat_timeout_s: Annotated[
        float,
        knob(
            "Seconds a node waits for the answer to one heartbeat (sent every second) "
            "before it counts as lost. Short, so that a heartbeat lost with a master that "
            "died holding it is noticed at once: the next one reaches the new leader, which "
            "answers 'unknown', and the node registers again (a reattachment within 5 s).",
            gt=0,
        ),
    ] = 1.5
    notice_timeout_s: Annotated[
        float,
        knob(
            "Seconds the master waits for a node to confirm an abort, and a stopping node "
            "for the master to confirm it left; best effort: past it they go on.",
            gt=0,
        ),
    ] = 2.0
    register_retry_s: Annotated[
        float,
        knob(
            "Pause (s) between a node's attempts to register while the master does not answer.",
            gt=0,
        ),
    ] = 0.2
    store_call_timeout_s: Annotated[
        float,
        knob(
            "Seconds a prefill or decode node's Store client waits for the master to answer "
            "one Store call, and for one batch of its KV transfers.",
            gt=0,
        ),
    ] = 10.0
    masters: Annotated[
        tuple[str, ...],
        knob(
            "host:port of every master's control plane when several masters run on etcd; "
            "nodes dial them all and the leader alone listens; empty = master and, on "
            "etcd, the masters registered there when the node starts."
        ),
    ] = ()
    state_dir: Annotated[
        str,
        knob(
            "Directory where a master without etcd journals the pool's committed state, so "
            'that a restart keeps the pool (docs/ha.md); "" = not kept. `up --local` sets it.'
        ),
    ] = ""

    @property
    def master_addresses(self) -> tuple[str, ...]:
        """host:port of every master nodes dial."""
        return self.masters or (self.master,)

    @property
    def etcd_key_prefix(self) -> str:
        """Where this cluster's keys live in etcd."""
        return f"{self.etcd_prefix.rstrip('/')}/{self.name}"

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
    nice: Annotated[
        int,
        knob(
            "CPU priority of this process (a nice value, 0-19): a prefill node that shares "
            "its host's cores with a decode node runs at a higher one, so decode steps (held "
            "to the TBT SLO) go first; 0 = as started. `up --local` sets 10 on prefill nodes "
            "when its nodes outnumber the cores.",
            ge=0,
            le=19,
        ),
    ] = 0
    instances: Annotated[
        str,
        knob(
            "Node processes `mooncake up` starts for a prefill or decode role, each a member "
            "of the cluster with its own id (<id>-<k>), ports (a share of port_range), KV "
            "cache, DRAM and SSD share and GPUs (CUDA_VISIBLE_DEVICES: an equal share of the "
            "visible ones); auto = one per visible GPU (1 on a CPU node, and for master and "
            "store, which refuse more than 1).",
            "count",
            pattern="^(auto|[1-9][0-9]*)$",
        ),
    ] = "auto"

    @property
    def num_instances(self) -> int | None:
        """`instances` as a number; None for auto (decided from the GPUs at start)."""
        return None if self.instances == "auto" else int(self.instances)


_TIER = "bytes, or a percentage of what the topology reports free; 0 disables the tier"


class StoreConfig(msgspec.Struct, **_STRUCT):
    """[store]: this node's share of the KVCache pool and the pool's policies."""

    vram_bytes: Annotated[Size, knob(f"GPU memory this node gives the pool: {_TIER}.", "size")] = (
        Size()
    )
    dram_bytes: Annotated[Size, knob(f"Host DRAM this node gives the pool: {_TIER}.", "size")] = (
        Size(fraction=0.5)
    )
    ssd_bytes: Annotated[
        Size,
        knob(
            "SSD space this node gives the pool: bytes, or a percentage of the free space of "
            "the SSD tier's filesystem; 0 disables the tier (and the search for an SSD).",
            "size",
        ),
    ] = Size(fraction=0.1)
    ssd_path: Annotated[
        str,
        knob(
            'Directory for the SSD tier; "" = found at start: a local SSD/NVMe filesystem '
            "(not rotational in sysfs; ext4, xfs, btrfs or f2fs; O_DIRECT accepted), most "
            "free space first, in ~/.cache/mooncake/ssd when that lies on it, else in "
            "<mountpoint>/mooncake; none found: the tier is off (one log line). A directory "
            "the tier cannot use (tmpfs, no O_DIRECT, too little space) stops the node with "
            "the reason."
        ),
    ] = ""
    replicas: Annotated[int, knob("Copies of each KV block kept in the pool.", ge=1)] = 1
    replica_budget: Annotated[
        float,
        knob(
            "Share of a memory tier's capacity that copies beyond `replicas` (hot-spot "
            "replicas the Conductor orders) may take; eviction drops such copies before the "
            "last copy of anything; 0: no hot-spot replicas.",
            ge=0,
            le=1,
        ),
    ] = 0.1
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
    put_wait_s: Annotated[
        float, knob("Seconds a put waits for room that demotions free; 0: fail at once.", ge=0)
    ] = 5.0
    put_retry_s: Annotated[
        float, knob("Seconds between the asks of a put waiting for room.", gt=0)
    ] = 0.01


# NOTE: the rdma_* keys come from RdmaConfig (mooncake/config/rdma.py); flags spelled out for mypy
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
    max_pending_handshakes: Annotated[
        int,
        knob(
            "Connections that may be in the handshake at once, from all addresses "
            "(authenticated connections do not count); one more pushes out the oldest "
            "of the address holding the most, so idle connections cannot keep real peers "
            "out.",
            ge=1,
        ),
    ] = 256
    stage_chunk_bytes: Annotated[
        int,
        knob(
            "GPU memory over tcp or shm moves through two pinned host buffers of this many "
            "bytes each, copying one chunk while the other is on the wire (a size without %).",
            "bytes",
            ge=4096,
        ),
    ] = 4 << 20


class ModelConfig(msgspec.Struct, **_STRUCT):
    """[model]: the model every prefill and decode node serves."""

    path: Annotated[
        str,
        knob(
            "A local HF model directory, a .gguf file (or a directory holding one), a built-in "
            'name (smollm2-135m-instruct), or "dummy:NAME" for random weights of a named shape.',
            "modelpath",
        ),
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
    cpu_gemm: Annotated[
        Literal["onednn", "torch"],
        knob(
            "CPU matmuls: onednn = weights packed once for oneDNN (as vLLM's CPU backend; "
            "falls back to torch where unsupported), torch = F.linear (MKL)."
        ),
    ] = "onednn"
    attention_backend: Annotated[
        Literal["auto", "torch", "triton", "flash"],
        knob(
            "Paged attention: auto = triton on a GPU, torch on a CPU; torch = SDPA a "
            "sequence at a time (the reference); triton = the whole batch in one launch "
            "per layer; flash = torch's varlen flash attention with a block table (CUDA "
            "builds that have it, block_tokens a multiple of 256)."
        ),
    ] = "auto"
    tensor_parallel: Annotated[
        int,
        knob(
            "Ranks one instance's layers are split over (Megatron-style: attention heads, "
            "MLP and expert widths, vocabulary), one process and GPU each, each loading "
            "only its slice of the weights; gloo on CPU, NCCL on GPUs (not run yet). 0 = "
            "automatic: 1 on a CPU; on GPUs the smallest power of two, at most the GPUs "
            "visible, that divides the model and leaves each GPU's share of the weights "
            "under 60% of its memory (the rest for the KV cache). node.instances = auto "
            "starts one instance per this many GPUs. Prefill and decode instances and "
            "`mooncake serve` alike; a prefill node that is one stage of a pipeline group "
            "runs one rank (auto there is 1).",
            ge=0,
        ),
    ] = 0
    cuda_graphs: Annotated[
        bool,
        knob(
            "Replay decode steps as CUDA graphs on a GPU (batch buckets 1, 2, 4, 8, then "
            "every 16 up to decode.max_batch; needs attention_backend triton); false = eager."
        ),
    ] = True


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
    kv_events: KvEventsConfig = KvEventsConfig()
    router: RouterConfig = RouterConfig()
