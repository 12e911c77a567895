"""`bench engine --parts handoff,inflight` end to end on dummy:tiny: a 1-stage and a
2-stage group (stage 1 a real child process streaming its layers) deliver every layer's
KV to the receiver; prompts in flight finish as one at a time do."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs

pytestmark = pytest.mark.cluster


def test_bench_engine_handoff_and_inflight_report_their_figures() -> None:
    args = [
        "bench",
        "engine",
        "--parts",
        "handoff,inflight",
        "--model",
        "dummy:tiny",
        "--handoff-len",
        "200",
        "--inflight-len",
        "150",
        "--inflight-count",
        "3",
        "--block-tokens",
        "16",
        "--chunk-tokens",
        "64",
        "--repeat",
        "1",
        "--json",
    ]
    load_verbs()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for shape in ("1-stage", "2-stage"):
        figures = report["handoff"][shape]
        assert figures["prefill_s"] > 0 and figures["ready_s"] > 0
        assert figures["ratio"] == figures["ready_s"] / figures["prefill_s"]
    inflight = report["inflight"]
    assert inflight["throughput_ratio"] == inflight["one_at_a_time_s"] / inflight["in_flight_s"]
    assert inflight["ideal_ratio"] == pytest.approx(3 * 4 / (3 * 3 + 1))  # 3 chunks, 2 stages
    assert (
        "prefill alone (streamed KV hand-off, 200-token prompt, 2-stage group)"
        in (report["runs_s"])
    )


def test_bench_engine_handoff_tp_moves_every_head_between_degrees() -> None:
    """`--parts handoff-tp`: each pair of degrees delivers every head of every token (the
    bench checks the receiver's blocks) and is reported against TP 1 -> TP 1."""
    args = ["bench", "engine", "--parts", "handoff-tp", "--model", "dummy:tiny"]
    args += ["--handoff-len", "70", "--block-tokens", "16", "--repeat", "1", "--json"]
    load_verbs()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)["handoff_tp"]
    assert figures["bytes"] == 70 * 4 * 2 * 2 * 64 * 4  # tokens, layers, K+V, heads, dim, fp32
    names = ["TP 1 -> TP 1", "TP 2 -> TP 2", "TP 2 -> TP 1", "TP 1 -> TP 2"]
    assert [n for n in figures if n != "bytes"] == names
    assert figures["TP 1 -> TP 1"]["vs_one_rank"] == 1.0
    assert all(figures[n]["GBps"] > 0 for n in names)
