"""`mooncake trace synth` and `mooncake trace stats`, and the misses in `mooncake sim`'s report."""

import json

from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from mooncake.sim.trace import load_trace
from tests.sim.toy import FIXTURE

load_verbs()
runner = CliRunner()


def _ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_synth_writes_a_trace_and_its_summary(tmp_path):
    out = tmp_path / "t.jsonl"
    args = ["trace", "synth", "-o", str(out), "--mix", "agent:2,docqa:1", "--sessions", "30"]
    summary = json.loads(_ok([*args, "--json", "--seed", "3"]))
    recs = load_trace(out)
    assert summary["requests"] == len(recs) and summary["bytes"] == out.stat().st_size
    assert sum(summary["sessions"].values()) == 30
    assert set(summary["sessions"]) <= {"agent", "docqa"}
    first = out.read_bytes()
    _ok([*args, "--seed", "3"])
    assert out.read_bytes() == first


def test_synth_names_the_bad_flag(tmp_path):
    result = runner.invoke(app, ["trace", "synth", "-o", str(tmp_path / "t"), "--rate", "-1"])
    assert result.exit_code != 0 and "--rate" in str(result.exception)
    result = runner.invoke(app, ["trace", "synth", "-o", str(tmp_path / "t"), "--doc-len", "x"])
    assert "--doc-len" in str(result.exception) and "MEAN:SPREAD" in str(result.exception)


def test_stats_json_and_table():
    data = json.loads(_ok(["trace", "stats", str(FIXTURE), "--sizes", "100,1000", "--json"]))
    for key in (
        "requests",
        "duration_s",
        "arrival_rate_rps",
        "input_length",
        "blocks",
        "distinct_blocks",
        "reused_block_share",
        "shared_prefixes",
        "top_prefixes",
        "reuse_distance",
        "unbounded_hit_rate",
        "lru",
    ):
        assert key in data, key
    assert data["requests"] == 300 and [p["pool_blocks"] for p in data["lru"]] == [100, 1000]
    text = _ok(["trace", "stats", str(FIXTURE)])
    assert "hit rate, unbounded" in text and "reuse distance" in text
    bad = runner.invoke(app, ["trace", "stats", str(FIXTURE), "--sizes", "0"])
    assert bad.exit_code != 0 and "--sizes" in str(bad.exception)


def test_sim_reports_misses_by_cause():
    args = ["sim", str(FIXTURE), "--prefill", "2", "--decode", "2", "--pool-blocks", "60"]
    m = json.loads(_ok([*args, "--json"]))["misses"]
    causes = ("hit", "cold", "evicted", "elsewhere", "unverified")
    assert sum(m[c] for c in causes) == m["blocks"] > 0
    assert set(m["shares"]) >= set(causes) and m["evicted"] > 0
    assert 0 < m["evicted_age_p50_s"] <= m["evicted_age_p90_s"]
    text = _ok(args)
    assert "blocks by cause" in text and "evicted" in text
