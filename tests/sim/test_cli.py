"""`mooncake sim`, `sim capacity`, `sim hitrate` and `bench conductor`: JSON keys and routing."""

import json

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from tests.sim.toy import FIXTURE

load_verbs()
runner = CliRunner()


def _json(args: list[str]) -> dict:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.output)


def test_sim_json_has_the_documented_keys():
    out = _json(
        [
            "sim",
            str(FIXTURE),
            "--limit",
            "100",
            "--speed",
            "2",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--json",
        ]
    )
    for key in (
        "completed",
        "rejected",
        "ttft_p90_s",
        "tbt_p90_s",
        "slo_attainment",
        "hit_rate",
        "local_hit_rate",
        "rejected_before_prefill",
        "prefill_gpu_s",
        "cluster",
    ):
        assert key in out, key
    assert out["requests"] == 100 and out["completed"] + out["rejected"] == 100


def test_options_after_the_trace_and_coupled_mode():
    out = _json(
        [
            "sim",
            "--json",
            str(FIXTURE),
            "--coupled",
            "3",
            "--limit",
            "50",
            "--policy",
            "load_balance",
        ]
    )
    assert out["cluster"].startswith("3 coupled") and "load_balance" in out["cluster"]


def test_sim_capacity_subcommand_is_not_taken_for_a_trace():
    out = _json(
        [
            "sim",
            "capacity",
            str(FIXTURE),
            "--limit",
            "60",
            "--hi",
            "4",
            "--tolerance",
            "0.5",
            "--json",
        ]
    )
    assert {"speed", "requests_per_s", "target", "bounded", "runs"} <= set(out)
    assert out["runs"] and all("slo_attainment" in run for run in out["runs"])


def test_sim_hitrate_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    out = _json(
        ["sim", "hitrate", str(FIXTURE), "--sizes", "10,0", "--json", "--plot", str(tmp_path)]
    )
    assert [row["pool_blocks"] for row in out["lru"]] == [10, None]
    assert out["lru"][0]["hit_rate"] <= out["lru"][1]["hit_rate"]
    assert (tmp_path / "hit_rate.png").stat().st_size > 0


def test_bad_flags_are_reported():
    result = runner.invoke(app, ["sim", str(FIXTURE), "--policy", "fastest", "--json"])
    assert result.exit_code != 0 and "policy 'fastest'" in str(result.exception)


def test_bench_conductor_json():
    out = _json(
        [
            "bench",
            "conductor",
            "--prefill",
            "4",
            "--decode",
            "4",
            "--blocks",
            "5000",
            "--decisions",
            "300",
            "--json",
        ]
    )
    assert out["indexed_blocks"] == 5000 and out["decisions"] == 300
    assert out["p99_us"] >= out["p50_us"] > 0 and out["decisions_per_s"] > 0


def test_sim_compare_runs_one_row_per_speed_and_value():
    """`sim compare` replays the trace once per (speed, value of --vary): the rows differ
    only in that setting, and each row's rejections add up from where they happened."""
    rows = _json(
        [
            "sim",
            "compare",
            str(FIXTURE),
            "--limit",
            "120",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--speeds",
            "2,4",
            "--vary",
            "rejection=none,predictive",
            "--json",
        ]
    )
    assert [(r["speed"], r["rejection"]) for r in rows] == [
        (2.0, "none"),
        (2.0, "predictive"),
        (4.0, "none"),
        (4.0, "predictive"),
    ]
    for r in rows:
        parts = (
            "rejected_ttft_slo",
            "rejected_decode_load",
            "rejected_at_prefill_start",
            "rejected_after_prefill",
        )
        assert r["rejected"] == sum(r[k] for k in parts)
        assert r["completed"] + r["rejected"] == r["requests"] == 120
    single = _json(
        [
            "sim",
            str(FIXTURE),
            "--limit",
            "120",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--speed",
            "4",
            "--rejection",
            "predictive",
            "--json",
        ]
    )
    assert single["rejected"] == rows[3]["rejected"]
    assert single["ttft_p90_s"] == rows[3]["ttft_p90_s"]


@pytest.mark.parametrize(
    ("vary", "why"),
    [("foo=1", "NAME one of"), ("binding=x", "late or arrival"), ("rejection=nope", "nope")],
)
def test_sim_compare_names_a_bad_vary(vary: str, why: str):
    result = runner.invoke(app, ["sim", "compare", str(FIXTURE), "--limit", "20", "--vary", vary])
    assert result.exit_code != 0 and why in str(result.output) + str(result.exception)
