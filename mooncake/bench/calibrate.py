"""Calibration: one trace slice replayed on a real local cluster and simulated on the same
shape with the same cost model, figure by figure (`mooncake bench cluster`).

    profile   the cost model `up --local` uses (`ensure_cost_model`: cached per shape)
    real      a fresh `up --local` cluster; the slice replayed through the OpenAI API
    sim       the same slice, scaled as the replay scaled it (`scaled_records`), on a
              simulated cluster of the same nodes, groups, settings and cost model
    compare   TTFT P50/P90, TBT P50/P90, hit rate, rejections; ratios sim / real

The figures are measured alike on both sides: TTFT from arrival (send) to the first token;
TBT percentiles over every token gap of every completed request (the simulator's gaps are
its decode steps, pooled the same way); hit rate = prompt tokens served from the pool over
prompt tokens, over completed requests; rejected = refused requests (HTTP 429 / rejected
by the Conductor or out of decode room). `per_request` pairs each request's two TTFTs.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from mooncake.api.status import TtftPhases
from mooncake.bench.hostprobe import (
    HostFigures,
    PathScales,
    cpu_per_work,
    cpu_seconds,
    idle_latency_s,
    idle_path_scales,
    idle_sim_ttft_s,
    role_processes,
)
from mooncake.bench.phases import master_status, sim_phases
from mooncake.conductor.costmodel import CostModel
from mooncake.config.load import load_config
from mooncake.config.settings import Config
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import ReplayReport, RequestRecord, figure_ratios
from mooncake.replay.runner import ReplayConfig, replay
from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import TraceRecord

FIGURES = ("ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s", "hit_rate", "rejected")
COST_CACHE = Path(tempfile.gettempdir()) / "mooncake-costmodels"  # shared with bench faults

OnRecord = Callable[[RequestRecord], None]
ReplayFn = Callable[[list[TraceRecord], PromptConfig, ReplayConfig, OnRecord], ReplayReport]


def _replay(
    records: list[TraceRecord], prompts: PromptConfig, cfg: ReplayConfig, on_record: OnRecord
) -> ReplayReport:
    return replay(records, prompts, cfg, None, on_record)


class Figures(msgspec.Struct, kw_only=True):
    """One side's figures (seconds; None where nothing was measured)."""

    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tbt_p50_s: float | None
    tbt_p90_s: float | None
    hit_rate: float | None  # prompt tokens served from the pool / prompt tokens
    rejected: int
    completed: int
    failed: int = 0
    # blocks by cause / blocks requested (conductor/misses.py): the simulator's, and the
    # server's where it sends them (usage.prompt_tokens_details.kv_blocks); {} otherwise
    block_shares: dict[str, float] = {}
    ssd_hit_share: float | None = None  # pool reads served from SSD / pool reads


class RequestPair(msgspec.Struct, array_like=True):
    """One request on both sides: [index, prompt tokens, real TTFT, sim TTFT, real
    status, sim status] (TTFT None where it got no token)."""

    index: int
    input_len: int
    real_ttft_s: float | None
    sim_ttft_s: float | None
    real_status: str  # ok | rejected | error
    sim_status: str  # done | rejected_early | rejected_start | rejected_late


class Calibration(msgspec.Struct, kw_only=True):
    """What `mooncake bench cluster --json` prints."""

    real: Figures
    sim: Figures
    ratio: dict[str, float | None]  # sim / real per figure (None: a side has no value)
    cluster: str  # the shape
    requests: int
    speed: float
    scale: float
    block_tokens: int
    cost_model: str  # the cost model file both sides used
    sim_wall_s: float
    host: HostFigures | None = None  # what the real runs measured of this host (medians)
    real_runs: list[Figures] = []  # each real run's figures (`real` is their median)
    # TTFT phases of the first real run (the master's) and of the twin (bench/phases.py)
    real_phases: TtftPhases | None = None
    sim_phases: TtftPhases | None = None
    per_request: list[RequestPair] = []  # the first real run's requests


@dataclasses.dataclass
class RealRun:
    """One replay on a fresh local cluster and what came with it."""

    report: ReplayReport
    seen: list[RequestRecord]
    config: Config
    host: HostFigures
    phases: TtftPhases | None  # the master's TTFT phases at the end
    tier_hits: dict[str, int]  # the Store's reads per tier (the master's status)


def scaled_records(records: list[TraceRecord], prompts: PromptConfig) -> list[TraceRecord]:
    """The requests as the replay sends them: scaled prompt and output lengths, the same
    blocks (now `prompts.block_tokens` long) and timestamps."""
    return [
        TraceRecord(r.timestamp, prompts.input_len(r), prompts.output_len(r), list(r.hash_ids))
        for r in records
    ]


def sim_config(
    plan: LocalPlan, config: Config, cost_path: Path, speed: float, host: HostFigures | None = None
) -> SimConfig:
    """The simulated twin of the local cluster `plan` running `config` on this host
    (`host`: what the real run measured; None = every node its own device)."""
    cost = CostModel.load(cost_path)
    nodes = plan.num_prefill + plan.num_decode + (plan.num_store if plan.pool else 0)
    dram = config.store.dram_bytes.num_bytes if plan.pool else 0  # a share: not modelled
    ssd = config.store.ssd_bytes.num_bytes if plan.pool else 0  # every node's, on prefill nodes
    block_bytes = cost.kv_bytes_per_token * plan.block_tokens
    sched, prefill = config.scheduler, config.prefill
    return SimConfig(
        num_prefill=plan.num_prefill,
        num_decode=plan.num_decode,
        group_size=plan.group_size,
        policy=sched.policy,
        rejection=sched.rejection,
        defer_s=sched.defer_s,
        defer_window_s=sched.defer_window_s,
        poll_s=sched.node_poll_s,
        balancing_threshold=sched.balancing_threshold,
        ttft_slo_s=sched.ttft_slo_s,
        tbt_slo_s=sched.tbt_slo_s,
        cost_model_path=str(cost_path),
        pool_blocks=nodes * dram // block_bytes,
        ssd_bytes=nodes * ssd // plan.num_prefill,
        block_tokens=plan.block_tokens,
        chunk_tokens=prefill.chunk_tokens,
        max_inflight=prefill.max_inflight,
        reserve_timeout_s=prefill.reserve_timeout_s,
        speed=speed,
        tp=1,
        host_cores=host.host_cores if host else 0.0,
        background_cores=host.background_cores if host else 0.0,
        prefill_nice=plan.prefill_nice if host else 0,
        prefill_scale=host.path.prefill if host else 1.0,
        decode_scale=host.path.decode if host else 1.0,
        prefill_cpu=host.prefill_cpu if host else 1.0,
        decode_cpu=host.decode_cpu if host else 1.0,
        decode_step_interval_s=plan.decode_step_interval_s,
        request_overhead_s=max(
            0.0, host.overhead_s - idle_sim_ttft_s(cost, plan.block_tokens, host.path)
        )
        if host
        else 0.0,
    )


def _weighted_pct(runs: list[tuple[float, int]], q: float) -> float | None:
    """The q-th percentile of values given as (value, count) runs."""
    runs = [(v, k) for v, k in runs if k > 0]
    if not runs:
        return None
    runs.sort()
    values = np.array([v for v, _ in runs])
    upto = np.cumsum([k for _, k in runs])
    rank = max(1, math.ceil(q / 100.0 * int(upto[-1])))
    return float(values[int(np.searchsorted(upto, rank))])


def simulate(cfg: SimConfig, records: list[TraceRecord]) -> tuple[Figures, float, Simulator]:
    """Run the simulator over `records`; its figures, its wall time (s) and itself."""
    sim = Simulator(cfg, records)
    sim.gap_runs = []
    report = sim.run()
    res = report.result
    done = [r for r in sim.requests if r.status == "done"]
    prompt = sum(r.input_len for r in done)
    reused = sum(min(r.reused_blocks * cfg.block_tokens, r.input_len - 1) for r in done)
    ttft = np.array(report.ttft_s)
    figures = Figures(
        ttft_p50_s=float(np.percentile(ttft, 50)) if len(ttft) else None,
        ttft_p90_s=float(np.percentile(ttft, 90)) if len(ttft) else None,
        tbt_p50_s=_weighted_pct(sim.gap_runs, 50),
        tbt_p90_s=_weighted_pct(sim.gap_runs, 90),
        hit_rate=reused / prompt if prompt else None,
        rejected=res.rejected,
        completed=res.completed,
        failed=res.failed,
        block_shares=res.misses.shares,
        ssd_hit_share=res.ssd_hit_share,
    )
    return figures, res.wall_s, sim


def real_figures(report: ReplayReport, tier_hits: dict[str, int] | None = None) -> Figures:
    hits = sum((tier_hits or {}).values())
    return Figures(
        ssd_hit_share=(tier_hits or {}).get("ssd", 0) / hits if hits else None,
        ttft_p50_s=report.ttft_p50_s,
        ttft_p90_s=report.ttft_p90_s,
        tbt_p50_s=report.tbt_p50_s,
        tbt_p90_s=report.tbt_p90_s,
        hit_rate=report.cached_token_share,
        rejected=report.rejected,
        completed=report.completed,
        failed=report.failed,
        block_shares={k: v for k, v in report.kv_block_shares.items() if k != "requested"},
    )


def ratios(real: Figures, sim: Figures) -> dict[str, float | None]:
    """sim / real per figure; None when either is missing or real is 0."""
    return figure_ratios(sim, real, FIGURES)


def calibrate(
    records: list[TraceRecord],
    prompts: PromptConfig,
    plan: LocalPlan,
    speed: float,
    replay_fn: ReplayFn = _replay,
    on_progress: Callable[[str], None] = lambda _: None,
    warmup: int = 2,
    repeat: int = 1,
) -> Calibration:
    """Profile (or reuse the cached cost model), replay `records` on a fresh local cluster
    of `plan`'s shape `repeat` times (after `warmup` requests one at a time, their prompts
    other tokens of the first records' shapes, not counted), simulate them once on its twin
    (deterministic), and compare: each real figure is the median over the runs, whose
    spread on a shared machine is often wider than the simulator's error."""
    cost = ensure_cost_model(plan, COST_CACHE, on_progress)
    runs = [
        _real_run(records, prompts, plan, speed, cost, replay_fn, on_progress, warmup)
        for _ in range(repeat)
    ]
    config = runs[0].config
    host = HostFigures(
        overhead_s=float(np.median([r.host.overhead_s for r in runs])),
        background_cores=float(np.median([r.host.background_cores for r in runs])),
        prefill_cpu_s=float(np.median([r.host.prefill_cpu_s for r in runs])),
        decode_cpu_s=float(np.median([r.host.decode_cpu_s for r in runs])),
        path=PathScales(
            prefill=float(np.median([r.host.path.prefill for r in runs])),
            decode=float(np.median([r.host.path.decode for r in runs])),
            prompt_tokens=runs[0].host.path.prompt_tokens,
        ),
    )
    reals = [real_figures(r.report, r.tier_hits) for r in runs]
    real = median_figures(reals)
    twin_records = scaled_records(records, prompts)
    _, _, first = simulate(sim_config(plan, config, cost, speed, host), twin_records)
    host.prefill_cpu, host.decode_cpu = cpu_per_work(host, first)  # NOTE: then again
    sim_cfg = sim_config(plan, config, cost, speed, host)
    sim, wall, run = simulate(sim_cfg, twin_records)
    shape = f"{plan.num_prefill}P (groups of {plan.group_size}) + {plan.num_decode}D"
    return Calibration(
        real=real,
        sim=sim,
        ratio=ratios(real, sim),
        cluster=f"{shape}, {plan.model}, pool {'on' if plan.pool else 'off'}",
        requests=len(records),
        speed=speed,
        scale=prompts.scale,
        block_tokens=plan.block_tokens,
        cost_model=str(cost),
        sim_wall_s=wall,
        host=host,
        real_runs=reals,
        per_request=pair_requests(runs[0].seen, run),
        real_phases=runs[0].phases,
        sim_phases=sim_phases(run.requests, sim_cfg.request_overhead_s),
    )


def _real_run(
    records: list[TraceRecord],
    prompts: PromptConfig,
    plan: LocalPlan,
    speed: float,
    cost: Path,
    replay_fn: ReplayFn,
    on_progress: Callable[[str], None],
    warmup: int,
) -> RealRun:
    """One replay on a fresh cluster, with what it measured of the host, where its
    requests' TTFT went and the Store's reads per tier (the master's status)."""
    launcher = LocalLauncher(plan, on_progress)
    launcher.runfile = plan.run_dir / "local.json"  # NOTE: never the user's own cluster's
    on_progress("starting the local cluster")
    launcher.start(str(cost))
    seen: list[RequestRecord] = []
    try:
        config = load_config(launcher.config_path).config
        slo = config.scheduler
        cfg = ReplayConfig(
            url=launcher.url,
            api_key=launcher.api_key,
            speed=speed,
            ttft_slo_s=slo.ttft_slo_s,
            tbt_slo_s=slo.tbt_slo_s,
        )
        if warmup:  # NOTE: a fresh cluster's first requests pay for lazy set-up
            on_progress(f"warming up with {warmup} requests (other tokens: no cache hits)")
            warm = dataclasses.replace(prompts, seed=prompts.seed + 1)
            replay(records[:warmup], warm, dataclasses.replace(cfg, concurrency=1, speed=1e9))
        on_progress("measuring the idle cluster's fixed latency")
        host = HostFigures(overhead_s=idle_latency_s(cfg, prompts))
        on_progress("measuring lone requests of the slice's lengths (median to P90)")
        model = CostModel.load(cost)
        pace = plan.decode_step_interval_s  # a --set of the bench's; 0 unless given
        host.path = idle_path_scales(cfg, prompts, model, records, host.overhead_s, pace_s=pace)
        groups = [role_processes(launcher, r) for r in ("control", "prefill", "decode")]
        cpu0, t0 = [cpu_seconds(g) for g in groups], time.monotonic()
        report = replay_fn(records, prompts, cfg, seen.append)
        used = [cpu_seconds(g) - c0 for g, c0 in zip(groups, cpu0, strict=True)]
        host.background_cores = used[0] / (time.monotonic() - t0)
        host.prefill_cpu_s, host.decode_cpu_s = used[1], used[2]
        status = master_status(launcher.url, launcher.api_key)
    finally:
        on_progress("stopping the local cluster")
        launcher.stop()
    return RealRun(
        report,
        seen,
        config,
        host,
        phases=status.ttft_phases if status else None,
        tier_hits={t.tier: t.num_hits for t in status.pool} if status else {},
    )


def median_figures(runs: list[Figures]) -> Figures:
    """Each figure's median over the runs (None where no run has it)."""

    def med(name: str) -> Any:
        values = [getattr(f, name) for f in runs if getattr(f, name) is not None]
        return float(np.median(values)) if values else None

    return Figures(
        ttft_p50_s=med("ttft_p50_s"),
        ttft_p90_s=med("ttft_p90_s"),
        tbt_p50_s=med("tbt_p50_s"),
        tbt_p90_s=med("tbt_p90_s"),
        hit_rate=med("hit_rate"),
        rejected=round(med("rejected") or 0),
        completed=round(med("completed") or 0),
        failed=round(med("failed") or 0),
        block_shares={
            k: float(np.median([f.block_shares.get(k, 0.0) for f in runs]))
            for k in (runs[0].block_shares if runs else {})
        },
        ssd_hit_share=med("ssd_hit_share"),
    )


def pair_requests(seen: list[RequestRecord], run: Simulator) -> list[RequestPair]:
    """Each request's real and simulated TTFT and fate, by trace position."""
    real = {r.index: r for r in seen}
    pairs = []
    for i, req in enumerate(run.requests):
        mine = real.get(i)
        pairs.append(
            RequestPair(
                i,
                req.input_len,
                mine.ttft_s if mine is not None else None,
                req.first_token_at - req.arrival if req.status == "done" else None,
                mine.status if mine is not None else "missing",
                req.status,
            )
        )
    return pairs
