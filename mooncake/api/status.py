"""The status snapshot: what the master serves at `GET /v1/status` and `mooncake status` shows.

One JSON object (msgspec, field names as below). The master builds it on request from
its registry, the Store's stats and its request records; `mooncake status` polls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from mooncake.store.metadata.objects import StoreStats

NodeState = Literal["starting", "ready", "draining", "failed", "down"]  # as the master sees it


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    role: str  # master | prefill | decode | store
    address: str  # host:port of its control endpoint (a store node: of its data plane)
    state: NodeState
    gpus: list[str] = []  # e.g. "NVIDIA H800 80GiB"; [] on a CPU node
    nics: list[str] = []  # RDMA NICs, e.g. "mlx5_0"; [] when none
    num_queued: int = 0  # requests waiting on this node
    num_running: int = 0  # requests running on this node
    num_reserved: int = 0  # decode: prompts streaming their KV into blocks set aside here
    load: float = 0.0  # 0..1: prefill busy share, or decode batch / max batch
    last_seen_s: float = 0.0  # seconds since its last heartbeat
    pipeline_group: str = ""  # prefill pipeline group this node belongs to, "" if none
    pool_bytes: dict[str, int] = {}  # tier -> bytes this node has mounted in the pool now
    transfer_bytes: dict[str, int] = {}  # transport (shm, tcp, rdma) -> bytes it moved


class TierStatus(msgspec.Struct, frozen=True, kw_only=True):
    tier: str  # vram | dram | ssd
    used_bytes: int
    capacity_bytes: int
    num_objects: int = 0
    num_hits: int = 0  # Store reads served from this tier since the master started


class TtftPhases(msgspec.Struct, kw_only=True):
    """Percentiles over the last `num_requests` requests (seconds; None when empty)."""

    num_requests: int
    queue_p50_s: float | None
    queue_p90_s: float | None
    prefill_p50_s: float | None  # start -> every layer's KV on the decode node
    prefill_p90_s: float | None
    first_step_p50_s: float | None  # KV landed -> the first token at the master
    first_step_p90_s: float | None
    predicted_over_actual_p50: float | None  # Conductor's TTFT / the real one


class KVBlockShares(msgspec.Struct, frozen=True, kw_only=True):
    """The prompt blocks prefills could have reused, by cause (roles/master/attribution.py):
    hit, cold, evicted, elsewhere, unverified, and the elsewhere parts (priced_out,
    plan_lost, after_placement); shares are of `blocks`."""

    requests: int = 0  # prefills attributed since start
    blocks: int = 0  # blocks they could have reused
    counts: dict[str, int] = {}  # cause or part -> blocks
    shares: dict[str, float] = {}  # cause or part -> share of blocks


class MasterStatus(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    address: str  # host:port of its control plane
    is_leader: bool  # the one serving the pool (the others forward their API to it)
    pid: int  # its process id on its host
    api: str = ""  # base URL of its HTTP API


class KvEventsStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Where the master publishes the pool's KV events (vLLM's format, docs/kv-events.md)."""

    endpoint: str  # ZeroMQ PUB address, bound (real port)
    replay_endpoint: str  # ZeroMQ ROUTER address for replays ("" = none)
    topic: str
    ranks: dict[str, int] = {}  # pool node id -> its data_parallel_rank in the batches


class BackendStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A vLLM instance the master routes to (`[router] backends`)."""

    name: str  # vllm-<i>, in the order of the config
    url: str
    num_blocks: int  # blocks of its cache the router has indexed (from its KV events)
    num_routed: int  # requests sent to it since start
    num_batches: int  # KV event batches received (num_replayed of them by replay)
    num_replayed: int


class Status(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    model: str
    uptime_s: float
    nodes: list[NodeStatus]
    pool: list[TierStatus]
    # NOTE: two different measures of reuse. `cached_token_share` is what the API reports
    # (usage.prompt_tokens_details.cached_tokens over prompt_tokens): the tokens the prefill
    # nodes did not compute, from the pool or their own cache. `hit_rate`/`local_hit_rate`
    # are the Conductor's view when it placed each request: prompt blocks its index showed
    # in the pool, or on the chosen node; blocks stored after placement count for neither.
    hit_rate: float  # share of prompt blocks found anywhere in the pool at placement
    local_hit_rate: float  # share of prompt blocks the chosen prefill node held at placement
    num_queued: int  # requests admitted and not yet producing tokens
    num_running: int  # requests decoding
    num_requests: int  # requests received since start (rejected ones too, refused ones not)
    num_completed: int
    rejected: int  # rejected by admission (HTTP 429)
    num_failed: int  # ended with an error
    ttft_p50_s: float | None  # over the recent window; None before any request finished
    ttft_p90_s: float | None
    tbt_p50_s: float | None
    tbt_p90_s: float | None
    ttft_slo_s: float
    tbt_slo_s: float
    transfer_bytes_per_s: float = 0.0  # KV moved between nodes, recent window
    pool_hits: int = 0  # prompt blocks served from the pool since start
    pool_lookups: int = 0  # prompt blocks looked up since start
    num_prompt_tokens: int = 0  # prompt tokens of the requests the API answered since start
    num_cached_tokens: int = 0  # of those, reported as cached (KV reused, not computed)
    cached_token_share: float = 0.0  # num_cached_tokens / num_prompt_tokens (0 before any)
    num_refused: int = 0  # bad requests refused with a 4xx (400/404/413): not received
    # refused for the prefill queue alone (scheduler.defer_s): waiting now for an idle
    # group, and since start placed after waiting / refused when none was idle in time
    num_waiting: int = 0
    num_waited: int = 0
    num_waited_out: int = 0
    ttft_phases: TtftPhases | None = None  # where TTFT went (the cluster's master only)
    masters: list[MasterStatus] = []  # every master process, the leader among them
    num_pool_objects: int = 0  # committed objects in the pool (what readers can get)
    kv_blocks: KVBlockShares | None = None  # why prefills missed (the cluster's master only)
    num_demotions: int = 0  # replicas moved down a tier (DRAM -> SSD) since start
    num_promotions: int = 0  # replicas moved up a tier on a hit (SSD -> DRAM) since start

    kv_events: KvEventsStatus | None = None  # the pool's KV event feed (None: not published)
    backends: list[BackendStatus] = []  # vLLM instances routed to (router mode only)


def pool_status(st: StoreStats) -> list[TierStatus]:
    """The Store's figures per tier (a stats snapshot) as status rows, by tier name."""
    return [
        TierStatus(
            tier=t,
            used_bytes=st.tier_used_bytes.get(t, 0),
            capacity_bytes=cap,
            num_objects=st.tier_objects.get(t, 0),
            num_hits=st.tier_hits.get(t, 0),
        )
        for t, cap in sorted(st.tier_capacity_bytes.items())
    ]


def host_port(address: str) -> str:
    """An address as status shows it: "tcp://10.0.0.1:7001" -> "10.0.0.1:7001"."""
    return address.split("://", 1)[-1]


def encode_status(status: Status) -> bytes:
    return msgspec.json.encode(status)


def decode_status(data: bytes) -> Status:
    """Parse a snapshot; raises msgspec.ValidationError / DecodeError on a bad body."""
    return msgspec.json.decode(data, type=Status)
