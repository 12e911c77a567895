"""The co-run slowdown: measured with real concurrent prefills, and a cost model scaled by
it predicts every prefill and decode step that much slower (the file records it)."""

from pathlib import Path

import pytest

from mooncake.conductor.costmodel import CorunFactors, CostModel
from mooncake.model.corun import measure_corun, scale_cost_model
from mooncake.model.profiling import profile_cost_model


@pytest.mark.cluster
def test_one_worker_is_no_slowdown_and_several_are_measured(tiny_info):
    assert measure_corun(tiny_info, "float32", 16, 64, 1) == CorunFactors(
        busy=1, prefill=1.0, decode=1.0
    )
    seen: list[str] = []
    f = measure_corun(tiny_info, "float32", 16, 64, 2, tokens=128, repeat=2, progress=seen.append)
    assert f.busy == 2 and f.prefill >= 1.0 and f.decode >= 1.0  # never a speed-up
    assert seen and "2 prefills at once" in seen[0]


def test_a_scaled_cost_model_predicts_by_the_factors_and_round_trips(tiny_info, tmp_path: Path):
    model, _, _ = profile_cost_model(
        tiny_info,
        "float32",
        16,
        64,
        [32, 64, 128, 256],
        [0.0, 0.5],
        [1, 2, 4],
        [32, 64],
        3,
        1,
        4096,
        2e9,
    )
    corun = CorunFactors(busy=2, prefill=1.3, decode=1.6)
    scaled = scale_cost_model(model, corun)
    for n, reused in ((100, 0), (256, 128)):
        assert scaled.prefill_time(n, reused) == pytest.approx(1.3 * model.prefill_time(n, reused))
    assert scaled.decode_step_time(3, 300) == pytest.approx(1.6 * model.decode_step_time(3, 300))
    assert "2 nodes computing at once" in scaled.spec.device
    scaled.save(tmp_path / "cm.json")
    again = CostModel.load(tmp_path / "cm.json")
    assert again.spec.corun == corun
    assert again.prefill_time(100) == pytest.approx(scaled.prefill_time(100))
