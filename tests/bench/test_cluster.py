"""`mooncake bench cluster`: a trace slice on a real local cluster and in the simulator."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.bench.calibrate import FIGURES, _weighted_pct, scaled_records
from mooncake.bench.hostprobe import probe_rank
from mooncake.replay.prompts import PromptConfig
from mooncake.sim.trace import load_trace

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"


def test_the_simulated_requests_are_the_replayed_ones() -> None:
    records = load_trace(TRACE, limit=5)
    prompts = PromptConfig(scale=0.0625, output_scale=0.0625, max_tokens=8)
    for rec, sim in zip(records, scaled_records(records, prompts), strict=True):
        assert sim.input_length == prompts.input_len(rec) == len(prompts.prompt_ids(rec))
        assert sim.output_length == prompts.output_len(rec) <= 8
        assert (sim.timestamp, sim.hash_ids) == (rec.timestamp, rec.hash_ids)


def test_pooled_gap_percentiles_weigh_each_run_by_its_count() -> None:
    runs = [(0.01, 9), (0.5, 1)]
    assert _weighted_pct(runs, 50) == 0.01 and _weighted_pct(runs, 90) == 0.01
    assert _weighted_pct(runs, 95) == 0.5 and _weighted_pct([], 50) is None


def test_path_probes_spread_from_the_median_to_the_90th_percentile() -> None:
    assert [probe_rank(201, i, 5) for i in range(5)] == [100, 120, 140, 160, 180]
    assert [probe_rank(4, i, 5) for i in range(5)] == [1, 1, 2, 2, 2]
    assert probe_rank(1, 0, 1) == 0  # one request: itself


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_bench_cluster_end_to_end_prints_real_sim_and_ratios(tmp_path: Path) -> None:
    args = ["bench", "cluster", str(TRACE), "--limit", "4", "--max-tokens", "6", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "mooncake", *args, "--model", "dummy:tiny"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    for side in ("real", "sim", "ratio"):
        assert set(FIGURES) <= set(data[side]), side
    real = data["real"]
    assert real["completed"] == data["sim"]["completed"] == 4
    for name in ("ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s", "hit_rate"):
        assert math.isfinite(real[name]) and real[name] >= 0, name
        assert math.isfinite(data["sim"][name]), name
    assert real["ttft_p50_s"] > 0 and data["ratio"]["ttft_p50_s"] > 0
    pairs = data["per_request"]  # [index, prompt tokens, real TTFT, sim TTFT, statuses]
    assert [p[0] for p in pairs] == [0, 1, 2, 3]
    assert all(p[2] > 0 and p[3] > 0 and p[4:] == ["ok", "done"] for p in pairs)
    assert "replay" in out.stderr  # the progress bar
    # where TTFT went, on both sides (the master counts the warm-up and idle probes too)
    real_ph, sim_ph = data["real_phases"], data["sim_phases"]
    assert real_ph["num_requests"] >= 4 and sim_ph["num_requests"] == 4
    for ph in (real_ph, sim_ph):
        assert ph["prefill_p50_s"] > 0 and ph["first_step_p50_s"] > 0 and ph["queue_p50_s"] >= 0
    # lone prompts of the slice's lengths priced the real path against the profile
    path = data["host"]["path"]
    assert path["prompt_tokens"] > 0
    assert 0.5 <= path["prefill"] <= 5.0 and 0.5 <= path["decode"] <= 5.0


def test_the_twin_waits_for_an_idle_group_as_the_cluster_is_configured_to(tmp_path: Path) -> None:
    import msgspec

    from mooncake.bench.calibrate import sim_config
    from mooncake.config.settings import Config
    from mooncake.local.launcher import LocalPlan
    from tests.sim.toy import write_toy_cost

    cost = Path(write_toy_cost(tmp_path / "cost.json"))
    config = Config()
    sched = msgspec.structs.replace(config.scheduler, defer_s=3.5, node_poll_s=0.1)
    twin = sim_config(LocalPlan(), msgspec.structs.replace(config, scheduler=sched), cost, 1.0)
    assert (twin.defer_s, twin.poll_s) == (3.5, 0.1)
    assert twin.conductor_params().defer_s == 3.5
    assert sim_config(LocalPlan(), Config(), cost, 1.0).defer_s == Config().scheduler.defer_s == 10
