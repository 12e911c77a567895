"""What crosses the Conductor's boundary: its settings, a request to place, its decision."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import msgspec

from mooncake.errors import ConfigError

POLICIES = ("random", "round_robin", "load_balance", "cache_aware", "kvcache_centric")
REJECTION_MODES = ("none", "basic", "predictive")

RejectReason = Literal["", "ttft_slo", "decode_load", "no_instance", "unknown_request"]


class ConductorParams(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of the Conductor (the `[scheduler]` section maps onto these)."""

    policy: str = "kvcache_centric"  # one of POLICIES
    rejection: str = "predictive"  # one of REJECTION_MODES
    ttft_slo_s: float = 30.0  # seconds
    tbt_slo_s: float = 0.1  # seconds per token
    balancing_threshold: float = 1.5  # Algorithm 1's kvcache_balancing_threshold
    block_tokens: int = 512  # tokens per KV block (the traces use 512)
    decode_time_s: float = 20.0  # §7.4's uniform decode time t_d until one is measured, s
    decode_time_ewma: float = 0.02  # weight of a finished request in t_d after 1/ewma of them
    # predictive, at arrival: reject when the predicted decode load is over 1 by this many
    # standard deviations of the forecast's measured error (the check at prefill start is sharp)
    forecast_sigmas: float = 2.0
    # a request refused only because of the queue ahead of it (its own TTFT meets the SLO)
    # may wait up to this many seconds for an idle prefill group (`Decision.can_wait`,
    # `Conductor.schedule(waited=True)`); 0 = refused at once (paper §7)
    defer_s: float = 0.0
    # ... and only while the prefill work offered, averaged over about this long, fits the
    # groups (`Conductor.offered_load` < 1): bursts wait, sustained overload does not
    defer_window_s: float = 30.0
    # choose the decode instance when the prefill starts (from the §7.4 per-instance
    # forecast), in every rejection mode; False: keep the one chosen at arrival, except
    # in predictive mode, whose check at prefill start chooses it anyway
    late_binding: bool = True
    global_pool: bool = True  # False: prefill reuses only its own cache (no remote fetch)
    stages: int = 1  # pipeline stages of a prefill group (its queue drains S times as fast)
    chunk_tokens: int = 0  # tokens per prefill chunk (0: a prompt is one chunk)
    # weight of a finished prefill in each group's learned speed (observed / predicted
    # latency, which then scales that group's predictions); 0 = trust the cost model
    speed_ewma: float = 0.2
    seed: int = 0  # random policy
    # price every prefill instance in Algorithm 1 (the reference); False: the bounded
    # candidate set with the same choice (`mooncake.conductor.candidates`)
    full_scan: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.rejection not in REJECTION_MODES:
            problems.append(
                f"rejection: {self.rejection!r} is not one of {', '.join(REJECTION_MODES)}"
            )
        for name in ("ttft_slo_s", "tbt_slo_s", "decode_time_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.balancing_threshold >= 1.0:
            problems.append(f"balancing_threshold: must be >= 1.0, got {self.balancing_threshold}")
        if self.stages < 1 or self.chunk_tokens < 0:
            problems.append(
                f"stages must be >= 1 and chunk_tokens >= 0, got {self.stages}, {self.chunk_tokens}"
            )
        if self.block_tokens < 1:
            problems.append(f"block_tokens: must be >= 1, got {self.block_tokens}")
        if not self.defer_s >= 0:
            problems.append(f"defer_s: must be >= 0, got {self.defer_s}")
        if not self.defer_window_s > 0:
            problems.append(f"defer_window_s: must be > 0, got {self.defer_window_s}")
        if not self.forecast_sigmas >= 0:
            problems.append(f"forecast_sigmas: must be >= 0, got {self.forecast_sigmas}")
        if not 0 <= self.speed_ewma <= 1:
            problems.append(f"speed_ewma: must be in [0, 1], got {self.speed_ewma}")
        if not 0 < self.decode_time_ewma <= 1:
            problems.append(f"decode_time_ewma: must be in (0, 1], got {self.decode_time_ewma}")
        if problems:
            raise ConfigError(problems)


class ScheduleRequest(msgspec.Struct, frozen=True):
    """A request to place: its length and its prompt's prefix-chained block hashes."""

    req_id: int
    input_len: int  # tokens
    block_hashes: Sequence[Hashable]  # block i's hash covers blocks 0..i


class ReplicationOrder(msgspec.Struct, frozen=True):
    """Hot-spot replication for the Store to carry out: copy blocks from src to dst."""

    block_hashes: tuple[Hashable, ...]
    src: str  # node holding them
    dst: str  # node that should hold a replica too


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request runs, what it reuses, and whether it is admitted at all."""

    req_id: int
    is_accepted: bool
    reason: RejectReason = ""  # why it was rejected ("" when accepted)
    prefill: str = ""  # prefill (or coupled) instance
    decode: str = ""  # decode instance (the prefill one when coupled)
    local_blocks: int = 0  # leading blocks the chosen prefill instance already holds
    best_blocks: int = 0  # longest prefix held by any node (the global pool's hit)
    reused_blocks: int = 0  # leading blocks prefill will not recompute
    fetch_from: str = ""  # node to fetch blocks [local_blocks, reused_blocks) from; "" = none
    ttft_s: float = 0.0  # predicted time to first token, seconds
    tbt_s: float = 0.0  # predicted time between tokens on the decode instance, seconds
    prefill_load: float = 0.0  # ttft_s / TTFT SLO
    decode_load: float = 0.0  # decode load per the rejection mode (0 when not checked)
    replications: tuple[ReplicationOrder, ...] = ()
    # rejected for the queue alone (TTFT SLO, own TTFT within it) and in the waiting room
    # (`mooncake.conductor.waiting`): offer it again (`Conductor.schedule(waited=True)`)
    # after `wait_s` seconds, when the next prefill group is predicted idle
    can_wait: bool = False
    wait_s: float = 0.0

    @property
    def fetch_blocks(self) -> int:
        return self.reused_blocks - self.local_blocks if self.fetch_from else 0


class PrefillAdmission(msgspec.Struct, frozen=True, kw_only=True):
    """The Conductor's answer when a request's prefill is about to start
    (`Conductor.admit_prefill`): run it, streaming its KV to `decode`, or drop it."""

    req_id: int
    is_accepted: bool
    decode: str = ""  # decode instance its KV streams to (may differ from the Decision's)
    reason: RejectReason = ""  # why it was rejected ("" when accepted)
    decode_load: float = 0.0  # predicted load of `decode` when the KV lands (predictive)
