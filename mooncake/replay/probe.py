"""What a real run of `bench cluster` measures of its host, for the simulated twin
(`HostFigures`): the idle cluster's fixed latency, the cores its control plane keeps busy,
and the loaded probe.

The loaded probe: how fast the fresh cluster serves a burst, against its simulated twin.

A cost model is profiled on one process with nothing else running. Deployed, a node also
streams KV, computes digests, answers RPCs and shares the host with the other nodes (on
`up --local`, all of them), so under load it serves requests slower than the profile says,
and near saturation a 10% slower service time is a 50% longer queue. Before the replay,
`burst_makespan_s` sends `num_requests` copies of the slice's median request at once (each
with its own tokens: no cache hits) and times the burst from the first send to the last
answer; `twin_makespan_s` simulates the same burst. Their ratio is the cluster's speed under
load relative to its cost model (`HostFigures.loaded_factor`), measured on requests that
are not the slice's: the twin's prefill and decode times are scaled by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import psutil

from mooncake.conductor.costmodel import CostModel
from mooncake.engine.corun import scale_times
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import RequestRecord
from mooncake.replay.runner import ReplayConfig, replay
from mooncake.roles.local import LocalLauncher
from mooncake.roles.runfile import write_private
from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import TraceRecord

PROBE_RUNS = 3  # loaded probes per real run; their median counts
PROBE_IDS = 1 << 42  # block ids of the probe's prompts: far from any trace's
FACTOR_BOUNDS = (0.5, 4.0)  # a probe outside them says something broke, not a speed


def burst_records(
    records: list[TraceRecord], num_requests: int, block_tokens: int
) -> list[TraceRecord]:
    """`num_requests` copies of the median request of `records` (`block_tokens` tokens a
    hash id, as in the trace), all sent at time 0, each with blocks of its own."""
    n_in = int(statistics.median(r.input_length for r in records))
    n_out = max(1, int(statistics.median(r.output_length for r in records)))
    per = -(-n_in // block_tokens)
    return [
        TraceRecord(0, n_in, n_out, [PROBE_IDS + i * per + j for j in range(per)])
        for i in range(num_requests)
    ]


def burst_makespan_s(
    cfg: ReplayConfig, prompts: PromptConfig, burst: list[TraceRecord]
) -> float | None:
    """Seconds from the first send to the last answer of `burst` sent at once; None when
    a request of it was refused or failed (the probe then says nothing)."""
    seen: list[RequestRecord] = []
    at_once = dataclasses.replace(cfg, concurrency=0, speed=1e9)
    replay(burst, dataclasses.replace(prompts, seed=prompts.seed + 3), at_once, None, seen.append)
    if len(seen) != len(burst) or any(r.status != "ok" for r in seen):
        return None
    return max(r.end_s for r in seen) - min(r.send_s for r in seen)


def twin_makespan_s(sim_cfg: SimConfig, burst: list[TraceRecord]) -> float | None:
    """The same burst on the simulated twin (`burst` already scaled as the replay sends it)."""
    sim = Simulator(msgspec.structs.replace(sim_cfg, speed=1.0, limit=None), burst)
    sim.run()
    if any(r.status != "done" for r in sim.requests):
        return None
    return max(r.done_at for r in sim.requests) - min(r.arrival for r in sim.requests)


def loaded_factor(real_s: float | None, twin_s: float | None) -> float:
    """real / twin makespan, within FACTOR_BOUNDS; 1 when either is unknown."""
    if not real_s or not twin_s:
        return 1.0
    lo, hi = FACTOR_BOUNDS
    return min(max(real_s / twin_s, lo), hi)


class HostFigures(msgspec.Struct, kw_only=True):
    """What the real run measured of its host, for the simulated twin: the latency a
    small request on the idle cluster has beyond its compute (API, master, RPCs, stage
    hops, streaming),
    and the cores the control plane kept busy during the replay (the master, store nodes
    and this process, whose replay client is part of the load)."""

    overhead_s: float = 0.0
    background_cores: float = 0.0
    loaded_s: float | None = None  # the loaded probe's makespan (replay/probe.py); None: none
    loaded_factor: float = 1.0  # its ratio to the twin's: the twin's times are scaled by it
    host_cores: float = msgspec.field(default_factory=lambda: float(len(os.sched_getaffinity(0))))


def idle_latency_s(cfg: ReplayConfig, prompts: PromptConfig, samples: int = 5) -> float:
    """Median TTFT of prompts of one block and one token, sent one at a time (the cluster
    idle): the block goes through the prefill group, so every stage hop is in it."""
    one = [
        TraceRecord(
            0, prompts.trace_block_tokens + 1, 1, [(1 << 40) + 2 * i, (1 << 40) + 2 * i + 1]
        )
        for i in range(samples)
    ]
    quiet = dataclasses.replace(cfg, concurrency=1, speed=1e9)
    seen: list[RequestRecord] = []
    replay(one, dataclasses.replace(prompts, seed=prompts.seed + 2), quiet, None, seen.append)
    ttfts = [r.ttft_s for r in seen if r.ttft_s is not None]
    return float(np.median(ttfts)) if ttfts else 0.0


def idle_sim_ttft_s(cost: CostModel, block_tokens: int) -> float:
    """The simulator's TTFT of `idle_latency_s`'s prompt: its prefill and one decode step."""
    n = block_tokens + 1
    return cost.prefill_time(n, 0) + cost.decode_step_time(1, n)


def control_plane(launcher: LocalLauncher) -> list[psutil.Process]:
    """The processes that do no model compute: the master, store nodes and this one."""
    procs = [psutil.Process()]
    for c in launcher.children:
        if c.role in ("master", "store"):
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


def probe_s(cfg: ReplayConfig, prompts: PromptConfig, burst: list[TraceRecord]) -> float | None:
    """The median makespan of PROBE_RUNS loaded probes (None when none said anything)."""
    spans = [s for _ in range(PROBE_RUNS) if (s := burst_makespan_s(cfg, prompts, burst))]
    return float(np.median(spans)) if spans else None


def loaded_copy(cost: Path, factor: float) -> Path:
    """The cost model at `cost` with its times scaled by the loaded probe's `factor`: the
    twin's (cached beside it, by factor)."""
    if factor == 1.0:
        return cost
    scaled = scale_times(CostModel.load(cost), factor, factor, "the loaded probe's speed")
    name = f"{cost.stem}-loaded-x{factor:.4f}.json"
    with tempfile.TemporaryDirectory() as tmp:  # save() follows symlinks; write_private not
        scaled.save(Path(tmp) / name)
        return write_private(cost.parent, name, (Path(tmp) / name).read_bytes())
