"""The simulator with the bounded Conductor gives the full scan's figures, to the last digit."""

import msgspec
import pytest

from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import run_sim
from mooncake.sim.trace import load_trace
from tests.sim.toy import FIXTURE


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_prefill=3, num_decode=2, speed=8.0),  # queues, fetches, rejections
        dict(num_prefill=40, num_decode=24, speed=4.0, pool_blocks=2_000),  # replicas, moves
        dict(num_prefill=4, num_decode=3, speed=4.0, rejection="basic", defer_s=5.0),
    ],
)
def test_bounded_conductor_matches_the_full_scan_on_a_trace_head(shape):
    """Every figure of the report (completed, rejected by reason, TTFT/TBT percentiles, hit
    rates, miss causes, GPU seconds) is the same with and without the full scan."""
    records = load_trace(FIXTURE)[:200]
    reports = []
    for full_scan in (True, False):
        result = run_sim(SimConfig(full_scan=full_scan, **shape), records).result
        reports.append({k: v for k, v in msgspec.to_builtins(result).items() if k != "wall_s"})
    assert reports[0] == reports[1]
    assert reports[0]["completed"] > 0
