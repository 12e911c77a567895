"""What a simulation runs: the cluster's shape, its hardware and model, its policies, the replay.

`SimConfig` is the frozen settings of one run; `mooncake sim` builds it from flags. A
cluster is either disaggregated (`num_prefill` + `num_decode` instances, the pool spread
over the prefill nodes' DRAM and SSD) or coupled (`num_coupled` vLLM-like instances,
each caching prefixes only in its own VRAM). One instance = one node of `tp` GPUs; the
prefill nodes form groups of `group_size` pipeline stages, each group one prefill instance
of the Conductor.

By default (`reserve_at_start`) a disaggregated run follows the cluster's data path: the
decode node's KV room is reserved when a prefill starts (the group waits, head of line,
while the node has no room, and the request fails after `reserve_timeout_s`), the KV
streams layer by layer during the prefill, and the decode node computes the first token.
Off, it runs the paper's §7 path: the decode instance checks the request when its KV
lands and may reject it after the prefill was spent, and the prefill gives the first token.
"""

from __future__ import annotations

import msgspec

from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.roofline import roofline_cost_model
from mooncake.conductor.types import POLICIES, REJECTION_MODES, ConductorParams
from mooncake.errors import ConfigError

GIB = 1 << 30


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one simulated run (sizes in bytes, times in seconds)."""

    num_prefill: int = 8
    num_decode: int = 8
    num_coupled: int = 0  # > 0: a coupled (vLLM-like) cluster instead of prefill + decode
    policy: str = "kvcache_centric"
    rejection: str = "predictive"
    balancing_threshold: float = 1.5
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    gpu: str = "A800"
    model: str = "llama2-70b"
    tp: int = 8  # GPUs per instance (tensor parallel)
    cost_model_path: str = ""  # a `mooncake profile` file instead of the roofline
    pool_blocks: int | None = None  # total DRAM blocks of the pool; None = from dram_bytes
    dram_bytes: int = 1024 * GIB  # per pool node, for KV blocks
    ssd_bytes: int = 0  # per pool node
    # share of the pool's memory that duplicates (hot-spot replicas) may take: [store]
    # replica_budget, the Store's policy (sim/pool.py)
    replica_budget: float = 0.1
    block_tokens: int = 512
    # tokens per prefill chunk (coupled: per iteration, vLLM's max_num_batched_tokens)
    chunk_tokens: int = 512
    group_size: int = 1  # prefill nodes per pipeline group (stages)
    max_inflight: int = 4  # requests in flight per prefill group
    reserve_at_start: bool = True  # the cluster's hand-off (module docstring)
    reserve_timeout_s: float = 30.0  # a prefill waits this long for decode room, then fails
    speed: float = 1.0  # replay speed factor: 2 = arrivals twice as dense
    limit: int | None = None  # replay only the first N requests
    tbt_share: float = 0.1  # a request's TBT = mean of this slowest share of its gaps
    late_binding: bool = True  # choose the decode instance at prefill start, in every mode
    # a request refused for the queue alone waits this long for an idle prefill group,
    # offered again when the next group is predicted idle, at most `poll_s` apart
    # (scheduler.defer_s, node_poll_s); 0 = refused at once
    defer_s: float = 0.0
    defer_window_s: float = 30.0  # ... while the offered load over about this long fits
    poll_s: float = 0.25
    # a cluster on one host (`up --local`): every node's compute shares `host_cores` cores,
    # `background_cores` of which the control plane (API, master, clients) keeps busy; a
    # prefill or decode step gets its CPU share of them by the nodes' nice values
    # (`sim/host.py`; prefill nodes at `prefill_nice`, the rest at 0). 0 = every node
    # has its own device, as on a real cluster
    host_cores: float = 0.0
    background_cores: float = 0.0
    prefill_nice: int = 0
    # the real path's cost over the cost model's compute (prefill groups and decode nodes
    # compute this much slower; the Conductor keeps the cost model): `bench cluster`'s
    # lone-request probes (bench/hostprobe.py); 1 = the profile is the whole cost
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    # cores a busy prefill stage / decode node wants per second of its compute (its
    # process's other threads too; `sim/host.py`); `bench cluster` measures them
    prefill_cpu: float = 1.0
    decode_cpu: float = 1.0
    request_overhead_s: float = 0.0  # control-plane latency before a request is scheduled
    # least seconds from one decode step's start to the next's (decode.step_interval_s)
    decode_step_interval_s: float = 0.0
    seed: int = 0
    # the Conductor prices every instance (the reference the bounded candidate set matches)
    full_scan: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.num_coupled < 0 or self.num_prefill < 0 or self.num_decode < 0:
            problems.append("instance counts must be >= 0")
        if self.num_coupled == 0 and (self.num_prefill < 1 or self.num_decode < 1):
            problems.append("need --prefill >= 1 and --decode >= 1, or --coupled >= 1")
        if self.policy not in POLICIES:
            problems.append(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.rejection not in REJECTION_MODES:
            problems.append(
                f"rejection {self.rejection!r} is not one of {', '.join(REJECTION_MODES)}"
            )
        if self.defer_s < 0 or not self.poll_s > 0:
            problems.append(
                f"defer_s must be >= 0 and poll_s > 0, got {self.defer_s}, {self.poll_s}"
            )
        if min(self.host_cores, self.background_cores, self.request_overhead_s) < 0:
            problems.append("host_cores, background_cores and request_overhead_s must be >= 0")
        if self.decode_step_interval_s < 0:
            problems.append("decode_step_interval_s must be >= 0")
        if not all(x > 0 for x in (self.prefill_scale, self.decode_scale)):
            problems.append("prefill_scale and decode_scale must be > 0")
        if not all(x > 0 for x in (self.prefill_cpu, self.decode_cpu)):
            problems.append("prefill_cpu and decode_cpu must be > 0")
        if not 0 <= self.prefill_nice <= 19:
            problems.append(f"prefill_nice must be in 0..19, got {self.prefill_nice}")
        if not self.speed > 0:
            problems.append(f"speed must be > 0, got {self.speed}")
        if self.limit is not None and self.limit < 1:
            problems.append(f"limit must be >= 1, got {self.limit}")
        if self.pool_blocks is not None and self.pool_blocks < 0:
            problems.append(f"pool blocks must be >= 0, got {self.pool_blocks}")
        if not 0 <= self.replica_budget <= 1:
            problems.append(f"replica_budget must be in [0, 1], got {self.replica_budget}")
        if self.chunk_tokens < 1 or self.block_tokens < 1 or self.tp < 1:
            problems.append("chunk_tokens, block_tokens and tp must be >= 1")
        if self.group_size < 1 or self.max_inflight < 1:
            problems.append("group_size and max_inflight must be >= 1")
        elif not self.is_coupled and self.num_prefill < self.group_size:
            problems.append(
                f"{self.num_prefill} prefill nodes cannot form a group of {self.group_size}"
            )
        if not self.reserve_timeout_s > 0:
            problems.append(f"reserve_timeout_s must be > 0, got {self.reserve_timeout_s}")
        if not 0 < self.tbt_share <= 1:
            problems.append(f"tbt_share must be in (0, 1], got {self.tbt_share}")
        if problems:
            raise ConfigError(problems)

    @property
    def is_coupled(self) -> bool:
        return self.num_coupled > 0

    @property
    def num_groups(self) -> int:
        """Prefill instances: groups of `group_size` prefill nodes."""
        return self.num_prefill // self.group_size

    @property
    def num_instances(self) -> int:
        return self.num_coupled or self.num_prefill + self.num_decode

    def conductor_params(self) -> ConductorParams:
        return ConductorParams(
            policy=self.policy,
            rejection=self.rejection,
            ttft_slo_s=self.ttft_slo_s,
            tbt_slo_s=self.tbt_slo_s,
            balancing_threshold=self.balancing_threshold,
            block_tokens=self.block_tokens,
            global_pool=not self.is_coupled,
            late_binding=self.late_binding,
            defer_s=self.defer_s,
            defer_window_s=self.defer_window_s,
            stages=1 if self.is_coupled else self.group_size,
            chunk_tokens=self.chunk_tokens,
            seed=self.seed,
            full_scan=self.full_scan,
        )

    def cost_model(self) -> CostModel:
        if self.cost_model_path:
            return CostModel.load(self.cost_model_path)
        return roofline_cost_model(self.model, self.gpu, self.tp)

    def pool_blocks_per_node(self, cost: CostModel) -> tuple[int | None, int]:
        """(DRAM-or-VRAM blocks, SSD blocks) of one pool node (a prefill group: the DRAM
        and SSD of its nodes)."""
        block_bytes = cost.kv_bytes_per_token * self.block_tokens
        if self.is_coupled:  # vLLM caches prefixes in the KV space of its own VRAM
            top = cost.kv_capacity_tokens // self.block_tokens
            if self.pool_blocks is not None:
                top = self.pool_blocks // self.num_coupled
            return top, 0
        nodes = self.group_size
        if self.pool_blocks is not None:
            top = self.pool_blocks // self.num_groups
        else:
            top = nodes * self.dram_bytes // block_bytes
        return top, nodes * self.ssd_bytes // block_bytes
