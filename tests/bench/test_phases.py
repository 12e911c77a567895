"""The twin's TTFT phases (`bench/phases.py`) add up to its TTFT, as the master's do."""

import pytest

from mooncake.bench.phases import sim_phases
from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import load_trace
from tests.sim.toy import write_toy_cost, write_trace


def test_a_lone_request_splits_into_overhead_prefill_and_its_first_step(tmp_path):
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 1000, 3, [1, 2])]
    cfg = SimConfig(
        num_prefill=1,
        num_decode=1,
        rejection="none",
        cost_model_path=cost,
        request_overhead_s=0.25,
        chunk_tokens=1000,
    )
    sim = Simulator(cfg, load_trace(write_trace(tmp_path / "t.jsonl", rows)))
    sim.run()
    (req,) = sim.requests
    ph = sim_phases(sim.requests, 0.25)
    assert ph.num_requests == 1
    assert ph.queue_p50_s == pytest.approx(0.0)  # placed after the overhead, started at once
    assert ph.prefill_p50_s == pytest.approx(1.0, rel=0.01)  # 1 ms a token, and the stream
    ttft = req.first_token_at - req.arrival
    assert 0.25 + ph.prefill_p50_s + ph.first_step_p50_s == pytest.approx(ttft)
    assert ph.first_step_p50_s > 0
    # requests that never ran count nowhere
    req.status = "rejected_early"
    assert sim_phases(sim.requests, 0.25).num_requests == 0
