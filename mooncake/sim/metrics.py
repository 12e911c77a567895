"""Per-request records of a simulation and the summary a run reports.

TTFT is arrival -> first token (the end of the first decode step on the cluster's path,
else the end of prefill). A request's TBT is the mean of its
slowest `tbt_share` (10%) token gaps, as FAST'25 measures it; the first gap runs from the
first token to the first decode step. A request meets the SLOs when it completes with
TTFT <= TTFT SLO and TBT <= TBT SLO; attainment counts rejected requests as misses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from mooncake.conductor.misses import CAUSES, ELSEWHERE_PARTS, MissCounts


class SimRequest:
    """One trace request's life in the simulator (times in seconds of simulated time)."""

    __slots__ = (
        "rid",
        "arrival",
        "input_len",
        "output_len",
        "hashes",
        "status",
        "decision",
        "fetch_ready",
        "reused_blocks",
        "prefill_start",
        "prefill_end",
        "stream_end",
        "ctx_key",
        "join_seg",
        "done_at",
        "tbt",
        "prefill_s",
        "first_token",
        "reserve_deadline",
        "reserved",
        "misses",
        "ssd_blocks",
        "waited",
    )

    def __init__(self, rid: int, arrival: float, input_len: int, output_len: int, hashes: list):
        self.rid = rid
        self.arrival = arrival
        self.input_len = input_len  # tokens
        self.output_len = output_len  # tokens, the first from prefill
        self.hashes = hashes
        # pending | done | rejected_early | rejected_start | rejected_late | failed (no
        # decode room within reserve_timeout_s: the cluster answers with an error)
        self.status = "pending"
        self.decision: Any = None
        self.fetch_ready = 0.0  # when fetched prefix blocks have arrived
        self.reused_blocks = 0
        self.prefill_start = self.prefill_end = self.stream_end = self.done_at = -1.0
        self.prefill_s = 0.0  # seconds of prefill compute
        self.ctx_key = 0  # decode bookkeeping: KV tokens at join minus the join step
        self.join_seg = 0  # decode bookkeeping: first step-log segment of the request
        self.tbt = 0.0  # mean of the slowest share of gaps, s
        self.first_token = -1.0  # when the decode node gave the first token (-1: prefill did)
        self.reserve_deadline = -1.0  # admitted to start: it fails when no room by then
        self.reserved = False  # its decode room is reserved
        self.misses: MissCounts | None = None  # its blocks by cause, once its prefill starts
        self.ssd_blocks = 0  # of reused_blocks, those read from an SSD tier
        self.waited = False  # admitted after waiting for an idle group (`defer_s`)

    @property
    def first_token_at(self) -> float:
        """When the client got the first token, s."""
        return self.prefill_end if self.first_token < 0 else self.first_token


def slowest_share_mean(gaps: list[tuple[float, int]], share: float) -> float:
    """Mean of the slowest `share` of gaps given as (seconds, count) runs."""
    total = sum(k for _, k in gaps)
    if total <= 0:
        return 0.0
    need = m = max(1, math.ceil(share * total))
    acc = 0.0
    for tau, k in sorted(gaps, reverse=True):
        take = k if k < need else need
        acc += tau * take
        need -= take
        if not need:
            break
    return acc / m


class MissSummary(msgspec.Struct, kw_only=True):
    """Blocks of the requests whose prefill started, by cause (`conductor/misses.py`); shares
    are of `blocks`, and `elsewhere` = `priced_out` + `plan_lost` + `after_placement`."""

    requests: int = 0
    blocks: int = 0
    hit: int = 0
    cold: int = 0
    evicted: int = 0
    elsewhere: int = 0
    priced_out: int = 0
    plan_lost: int = 0
    after_placement: int = 0
    unverified: int = 0
    shares: dict[str, float] = msgspec.field(default_factory=dict)
    evicted_age_p50_s: float = 0.0  # last use anywhere in the pool -> last copy dropped
    evicted_age_p90_s: float = 0.0


def summarize_misses(reqs: list[SimRequest]) -> MissSummary:
    names = (*CAUSES, *ELSEWHERE_PARTS)
    sums = [0] * len(names)
    started = 0
    evicted_ages: list[float] = []
    for r in reqs:
        c = r.misses
        if c is not None:
            started += 1
            evicted_ages += c.evicted_age_s
            for k, name in enumerate(names):
                sums[k] += getattr(c, name)
    totals = dict(zip(names, sums, strict=True))
    blocks = sum(sums[: len(CAUSES)])
    ages = np.asarray(evicted_ages, dtype=float)
    return MissSummary(
        requests=started,
        blocks=blocks,
        **totals,
        shares={k: v / (blocks or 1) for k, v in totals.items()},
        evicted_age_p50_s=_pct(ages, 50),
        evicted_age_p90_s=_pct(ages, 90),
    )


class SimResult(msgspec.Struct, kw_only=True):
    """What `mooncake sim` reports (seconds unless named otherwise)."""

    requests: int
    completed: int
    rejected: int
    rejected_before_prefill: int  # at arrival or when the prefill was about to start
    rejected_ttft_slo: int  # of which at arrival: predicted TTFT over the SLO
    rejected_decode_load: int  # of which at arrival: decode load over the limit
    rejected_at_prefill_start: int  # of which when the prefill was about to start
    rejected_after_prefill: int
    failed: int  # no decode room within reserve_timeout_s (an error, not a rejection)
    waited: int  # admitted after waiting for an idle prefill group (scheduler.defer_s)
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    slo_attainment: float  # share of all requests completed within both SLOs
    ttft_attainment: float  # share of completed requests within the TTFT SLO
    tbt_attainment: float  # share of completed requests within the TBT SLO
    hit_rate: float  # blocks held anywhere in the pool / blocks requested
    local_hit_rate: float  # blocks held by the chosen instance itself / blocks requested
    reuse_rate: float  # blocks not recomputed / blocks prefilled
    ssd_hit_share: float  # of the blocks not recomputed, those read from an SSD tier
    prefill_gpu_s: float  # GPU-seconds of prefill compute (instance seconds x GPUs)
    wasted_prefill_gpu_s: float  # of which for requests rejected after prefill
    makespan_s: float  # simulated time from first arrival to last completion
    goodput_rps: float  # requests within both SLOs per second of trace time
    speed: float
    misses: MissSummary = msgspec.field(default_factory=MissSummary)
    wall_s: float = 0.0


@dataclass
class SimReport:
    result: SimResult
    ttft_s: list[float] = field(default_factory=list)  # completed requests
    tbt_s: list[float] = field(default_factory=list)


def _early(reqs: list[SimRequest], reason: str) -> int:
    return sum(r.status == "rejected_early" and r.decision.reason == reason for r in reqs)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(
    reqs: list[SimRequest],
    *,
    ttft_slo_s: float,
    tbt_slo_s: float,
    gpus_per_instance: int,
    span_s: float,
    speed: float,
) -> SimReport:
    """Aggregate the per-request records of a finished run."""
    done = [r for r in reqs if r.status == "done"]
    ttft = np.array([r.first_token_at - r.arrival for r in done], dtype=float)
    tbt = np.array([r.tbt for r in done], dtype=float)
    ok_ttft, ok_tbt = ttft <= ttft_slo_s, tbt <= tbt_slo_s
    met = int(np.count_nonzero(ok_ttft & ok_tbt))
    decided = [r for r in reqs if r.decision is not None]
    blocks = sum(len(r.hashes) for r in decided) or 1
    prefilled = [r for r in reqs if r.prefill_end >= 0]
    start = min((r.arrival for r in reqs), default=0.0)
    end = max((r.done_at for r in reqs), default=0.0)
    n_done = len(done) or 1
    result = SimResult(
        requests=len(reqs),
        completed=len(done),
        rejected=sum(r.status.startswith("rejected") for r in reqs),
        rejected_before_prefill=sum(r.status in ("rejected_early", "rejected_start") for r in reqs),
        rejected_ttft_slo=_early(reqs, "ttft_slo"),
        rejected_decode_load=_early(reqs, "decode_load"),
        rejected_at_prefill_start=sum(r.status == "rejected_start" for r in reqs),
        rejected_after_prefill=sum(r.status == "rejected_late" for r in reqs),
        failed=sum(r.status == "failed" for r in reqs),
        waited=sum(r.waited for r in reqs),
        ttft_mean_s=float(ttft.mean()) if len(ttft) else 0.0,
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        tbt_p50_s=_pct(tbt, 50),
        tbt_p90_s=_pct(tbt, 90),
        tbt_p99_s=_pct(tbt, 99),
        slo_attainment=met / max(len(reqs), 1),
        ttft_attainment=int(np.count_nonzero(ok_ttft)) / n_done,
        tbt_attainment=int(np.count_nonzero(ok_tbt)) / n_done,
        hit_rate=sum(r.decision.best_blocks for r in decided) / blocks,
        local_hit_rate=sum(r.decision.local_blocks for r in decided) / blocks,
        reuse_rate=sum(r.reused_blocks for r in prefilled)
        / (sum(len(r.hashes) for r in prefilled) or 1),
        ssd_hit_share=sum(r.ssd_blocks for r in prefilled)
        / (sum(r.reused_blocks for r in prefilled) or 1),
        prefill_gpu_s=sum(r.prefill_s for r in prefilled) * float(gpus_per_instance),
        wasted_prefill_gpu_s=sum(r.prefill_s for r in reqs if r.status == "rejected_late")
        * float(gpus_per_instance),
        makespan_s=max(end - start, 0.0),
        goodput_rps=met / span_s,
        speed=speed,
        misses=summarize_misses(reqs),
    )
    return SimReport(result, ttft.tolist(), tbt.tolist())
