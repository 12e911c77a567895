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
