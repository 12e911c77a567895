"""What `bench cluster`'s real run measures of its host, for the simulated twin
(`HostFigures`): the cores the control plane keeps busy during the replay, and what the idle
local cluster takes beyond its cost model, measured with lone requests.

`bench cluster`'s twin computes with the cost model `up --local` profiled: the engine's
compute alone, on one process. A real request does more: it crosses the API and the master
(a fixed latency), and its prefill streams each layer's KV to the decode node and writes it
into pool objects while the stages hand activations on; each decode step sends its tokens
back through the master. On a small model that work is a large share of the time. Before
the replay, on the idle cluster, lone requests measure it:

- `idle_latency_s`: prompts of one block and one output token: the fixed latency;
- `idle_path_scales`: prompts of the slice's lengths from its median to its 90th
  percentile (other tokens: no cache hits), one at a time: the sum of (TTFT - the fixed
  latency) over the sum of the cost model's prefill of their extra tokens, and their token
  gaps over the cost model's decode step of a batch of one. A ratio of sums over prompts
  as long as the ones that load the cluster: a single short prompt's prefill is a few
  tens of milliseconds on a small model, within the jitter of one sample.

The twin's prefill groups and decode nodes compute at those factors; its Conductor keeps
the cost model the real master uses, so both schedulers price requests alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import psutil

from mooncake.conductor.costmodel import CostModel
from mooncake.local.launcher import LocalLauncher
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import RequestRecord
from mooncake.replay.runner import ReplayConfig, replay
from mooncake.sim.trace import TraceRecord

if TYPE_CHECKING:
    from mooncake.sim.simulator import Simulator

SCALE_BOUNDS = (0.5, 5.0)  # a probe outside these measured something else: clamped
PROBE_ID_BASE = 1 << 40  # hash ids far from any trace's, so probes never hit its blocks


class PathScales(msgspec.Struct, kw_only=True):
    """The idle cluster's path against its cost model (1 = the profile is the whole cost)."""

    prefill: float = 1.0  # a prompt's prefill path / the profiled prefill compute
    decode: float = 1.0  # a token gap / the profiled decode step of a batch of one
    prompt_tokens: int = 0  # the probe's prompt length (after scaling)


class HostFigures(msgspec.Struct, kw_only=True):
    """What the real run measured of its host, for the simulated twin: the latency a
    small request on the idle cluster has beyond its compute (API, master, RPCs, stage
    hops, streaming),
    and the cores the control plane kept busy during the replay (the master, store nodes
    and this process, whose replay client is part of the load)."""

    overhead_s: float = 0.0
    background_cores: float = 0.0
    path: PathScales = msgspec.field(default_factory=PathScales)
    # CPU seconds the prefill and the decode nodes' processes used during the replay (all
    # their threads: compute, KV stream, copies, links); the twin prices them per second of
    # its own compute (`cpu_per_work`)
    prefill_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    # from those: the cores a busy prefill stage / decode node wants (`cpu_per_work`)
    prefill_cpu: float = 1.0
    decode_cpu: float = 1.0
    host_cores: float = msgspec.field(default_factory=lambda: float(len(os.sched_getaffinity(0))))


def role_processes(launcher: LocalLauncher, *roles: str) -> list[psutil.Process]:
    """The cluster's processes of `roles` ("control": the master, store nodes and this
    process, whose replay client is part of the load; else a node role)."""
    wanted = {"master", "store"} if "control" in roles else set(roles)
    procs = [psutil.Process()] if "control" in roles else []
    for c in launcher.children:
        if c.role in wanted:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(c.proc.pid))
    return procs


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _lone(
    records: list[TraceRecord], cfg: ReplayConfig, prompts: PromptConfig, seed: int
) -> list[RequestRecord]:
    """Replay `records` one at a time, as fast as they complete."""
    quiet = dataclasses.replace(cfg, concurrency=1, speed=1e9)
    seen: list[RequestRecord] = []
    replay(
        records, dataclasses.replace(prompts, seed=prompts.seed + seed), quiet, None, seen.append
    )
    return [r for r in seen if r.status == "ok" and r.ttft_s is not None]


def _probe(i: int, blocks: int, input_length: int, output_length: int) -> TraceRecord:
    ids = [PROBE_ID_BASE + 1000 * i + b for b in range(blocks)]
    return TraceRecord(0, input_length, output_length, ids)


def idle_latency_s(cfg: ReplayConfig, prompts: PromptConfig, samples: int = 5) -> float:
    """Median TTFT of prompts of one block and one token, sent one at a time (the cluster
    idle): the block goes through the prefill group, so every stage hop is in it."""
    one = [_probe(i, 2, prompts.trace_block_tokens + 1, 1) for i in range(samples)]
    ttfts = [r.ttft_s for r in _lone(one, cfg, prompts, 2) if r.ttft_s is not None]
    return float(np.median(ttfts)) if ttfts else 0.0


def idle_sim_ttft_s(cost: CostModel, block_tokens: int, scales: PathScales) -> float:
    """The twin's compute in `idle_latency_s`'s prompt: its prefill and one decode step at
    the path's scales (the rest of that TTFT is the twin's fixed latency)."""
    n = block_tokens + 1
    return cost.prefill_time(n, 0) * scales.prefill + cost.decode_step_time(1, n) * scales.decode


def idle_path_scales(
    cfg: ReplayConfig,
    prompts: PromptConfig,
    cost: CostModel,
    records: list[TraceRecord],
    overhead_s: float,
    samples: int = 5,
    output_tokens: int = 16,
    pace_s: float = 0.0,
) -> PathScales:
    """Lone prompts of `records`' lengths against the cost model (module docstring). A
    paced decode node (`pace_s`: decode.step_interval_s) spaces steps that compute faster
    than the pace: a gap is priced against the longer of the profiled step and the pace,
    so such steps measure 1 (their compute hidden by the pace) and slower ones their own
    cost."""
    ranked = sorted(records, key=lambda r: r.input_length)
    picks = [ranked[probe_rank(len(ranked), i, samples)] for i in range(samples)]
    out = max(2, round(output_tokens / prompts.output_scale))  # NOTE: the replay scales it
    probes = [_probe(10 + i, len(r.hash_ids), r.input_length, out) for i, r in enumerate(picks)]
    bt = prompts.block_tokens
    lengths = [prompts.input_len(r) for r in picks]  # by position, as the replay numbers them
    scales = PathScales(prompt_tokens=lengths[samples // 2])
    spent = extra = 0.0
    gaps: list[float] = []
    for r in _lone(probes, cfg, prompts, 3):
        n = lengths[r.index] if 0 <= r.index < len(lengths) else 0
        if r.ttft_s is None or n <= bt + 1:
            continue
        spent += r.ttft_s - overhead_s
        extra += cost.prefill_time(n, 0) - cost.prefill_time(bt + 1, 0)
        step = max(cost.decode_step_time(1, n + output_tokens // 2), pace_s)
        gaps += [g / step for g in r.gaps_s]
    if extra > 0:
        scales.prefill = _clamp(spent / extra)
    if gaps:
        scales.decode = _clamp(float(np.median(gaps)))
    return scales


def probe_rank(count: int, i: int, samples: int) -> int:
    """The rank of the i-th of `samples` probes among `count` sorted lengths: evenly from
    the median to the 90th percentile."""
    q = 0.5 + 0.4 * i / max(1, samples - 1)
    return min(count - 1, int(q * (count - 1)))


def cpu_per_work(host: HostFigures, twin: Simulator) -> tuple[float, float]:
    """The cores a busy prefill stage and a busy decode node want, per second of the
    twin's compute for them: the CPU seconds their processes used during the replay over
    the twin's compute seconds on the same slice (1 where either side has none)."""
    prefill_work = sum(p.busy_s for p in twin.prefill.values())
    decode_work = sum(d.work_s for d in twin.decode.values())
    return (
        _clamp(host.prefill_cpu_s / prefill_work) if prefill_work and host.prefill_cpu_s else 1.0,
        _clamp(host.decode_cpu_s / decode_work) if decode_work and host.decode_cpu_s else 1.0,
    )


def _clamp(x: float) -> float:
    lo, hi = SCALE_BOUNDS
    return min(hi, max(lo, x))
