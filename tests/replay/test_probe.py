"""The loaded probe: a burst of the slice's median request, each with blocks of its own,
timed on the twin; the factor is real / twin, bounded; the twin's cost model scaled by it."""

from pathlib import Path

import pytest

from mooncake.conductor.costmodel import CostModel
from mooncake.replay.calibrate import scaled_records
from mooncake.replay.probe import (
    FACTOR_BOUNDS,
    burst_records,
    loaded_copy,
    loaded_factor,
    twin_makespan_s,
)
from mooncake.replay.prompts import PromptConfig
from mooncake.roles.local import LocalPlan
from mooncake.sim.cluster import SimConfig
from mooncake.sim.trace import TraceRecord, load_trace

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"


def test_a_burst_is_the_median_request_with_blocks_of_its_own():
    recs = [
        TraceRecord(0, n, o, list(range(-(-n // 512))))
        for n, o in ((600, 10), (1500, 30), (900, 20))
    ]
    burst = burst_records(recs, 4, 512)
    assert [(r.timestamp, r.input_length, r.output_length) for r in burst] == [(0, 900, 20)] * 4
    ids = [i for r in burst for i in r.hash_ids]
    assert all(len(r.hash_ids) == 2 for r in burst) and len(set(ids)) == len(ids)
    assert not set(ids) & {i for r in recs for i in r.hash_ids}  # no hit on the slice's


def test_the_factor_is_real_over_twin_within_bounds_and_1_when_unknown():
    assert loaded_factor(3.0, 2.0) == 1.5
    assert loaded_factor(100.0, 1.0) == FACTOR_BOUNDS[1]
    assert loaded_factor(0.1, 1.0) == FACTOR_BOUNDS[0]
    assert loaded_factor(None, 2.0) == loaded_factor(3.0, None) == 1.0


def test_the_twin_serves_the_burst_and_a_slower_model_takes_longer(tmp_path: Path):
    from mooncake.engine.modelinfo import load_model_info
    from mooncake.engine.profiling import profile_cost_model

    model, _, _ = profile_cost_model(
        load_model_info("dummy:tiny"), "float32", 32, 256, [64, 256, 512, 1024], [0.0, 0.5],
        [1, 4], [64, 256], 3, 1, 8192, 2e9,
    )  # fmt: skip
    path = tmp_path / "cm.json"
    model.save(path)
    prompts = PromptConfig(scale=0.0625, output_scale=0.0625)
    burst = scaled_records(burst_records(load_trace(TRACE, limit=50), 8, 512), prompts)
    plan = LocalPlan(num_prefill=1, group_size=1)

    def twin(cost: Path) -> float | None:
        cfg = SimConfig(num_prefill=plan.num_prefill, num_decode=1, cost_model_path=str(cost),
                        block_tokens=32, chunk_tokens=256, ttft_slo_s=600.0)  # fmt: skip
        return twin_makespan_s(cfg, burst)

    base = twin(path)
    assert base is not None and base > 0
    slower = loaded_copy(path, 2.0)
    assert slower != path and CostModel.load(slower).prefill_time(500) == pytest.approx(
        2 * model.prefill_time(500)
    )
    again = twin(slower)
    assert again is not None and again > 1.5 * base
    assert loaded_copy(path, 1.0) == path
