"""Trace-driven discrete-event cluster simulator that drives the real Conductor.

    from mooncake.sim import SimConfig, load_trace, run_sim
    report = run_sim(SimConfig(num_prefill=8, num_decode=8, speed=1.5), load_trace(path))
    report.result.ttft_p90_s, report.result.slo_attainment

Modules: `trace` (Mooncake-format JSONL), `cluster` (SimConfig), `simulator` (event loop),
`prefill` / `decode` / `coupled` (instance models), `pool` (the tiered KV pool under the
Store's eviction order, and the global-LRU hit rate), `misses` (why each block a request
did not reuse missed), `metrics` (per-request records and the summary), `capacity`
(bisection on replay speed), `plot` (PNG figures, matplotlib optional), `synth`
(synthetic traces from a workload description), `tracestats` (what a trace holds:
sharing, reuse distances).
"""

from mooncake.sim.capacity import CapacityResult, find_capacity
from mooncake.sim.cluster import SimConfig
from mooncake.sim.lru import global_lru_hit_rate
from mooncake.sim.metrics import SimReport, SimResult
from mooncake.sim.simulator import Simulator, run_sim
from mooncake.sim.trace import TraceError, TraceRecord, load_trace

__all__ = [
    "CapacityResult",
    "SimConfig",
    "SimReport",
    "SimResult",
    "Simulator",
    "TraceError",
    "TraceRecord",
    "find_capacity",
    "global_lru_hit_rate",
    "load_trace",
    "run_sim",
]
