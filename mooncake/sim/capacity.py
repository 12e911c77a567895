"""Effective request capacity: the highest replay speed at which a cluster keeps its SLOs.

A run "meets the SLOs" when at least `target` of all requests (rejected ones count as
misses) complete with TTFT <= TTFT SLO and TBT <= TBT SLO. Attainment falls as the speed
rises, so the boundary is found by bisection on the speed factor, geometrically (speeds
span orders of magnitude), until the bracket is within `rel_tol`. Capacity in requests per
second is the speed times the trace's mean arrival rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import run_sim
from mooncake.sim.trace import TraceRecord, trace_span_s


class CapacityRun(msgspec.Struct, frozen=True):
    speed: float
    slo_attainment: float
    meets: bool


class CapacityResult(msgspec.Struct, frozen=True, kw_only=True):
    speed: float  # highest speed found to meet the SLOs (0 when even `lo` fails)
    requests_per_s: float  # speed x the trace's arrival rate at speed 1
    target: float  # share of requests that must meet both SLOs
    bounded: bool  # False when `hi` itself met the target (capacity is at least `speed`)
    runs: list[CapacityRun]


def find_capacity(
    cfg: SimConfig,
    records: list[TraceRecord],
    *,
    target: float = 0.9,
    lo: float = 0.05,
    hi: float = 8.0,
    rel_tol: float = 0.03,
    progress: Callable[[CapacityRun], None] | None = None,
) -> CapacityResult:
    """Bisect the replay speed of `records` on cluster `cfg` (its own speed is ignored)."""
    assert 0 < lo < hi and 0 < target <= 1 and rel_tol > 0, (lo, hi, target, rel_tol)
    records = records[: cfg.limit] if cfg.limit else records
    runs: list[CapacityRun] = []

    def meets(speed: float) -> bool:
        result = run_sim(msgspec.structs.replace(cfg, speed=speed, limit=None), records).result
        run = CapacityRun(speed, result.slo_attainment, result.slo_attainment >= target)
        runs.append(run)
        if progress is not None:
            progress(run)
        return run.meets

    rate = len(records) / trace_span_s(records)
    if meets(hi):
        return CapacityResult(
            speed=hi, requests_per_s=hi * rate, target=target, bounded=False, runs=runs
        )
    if not meets(lo):
        return CapacityResult(speed=0.0, requests_per_s=0.0, target=target, bounded=True, runs=runs)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(
        speed=lo, requests_per_s=lo * rate, target=target, bounded=True, runs=runs
    )
