"""RequestStats: TTFT is arrival to first token, TBT each later gap; counts by outcome; a
bounded window; percentiles as numpy computes them; Prometheus metrics mirror it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from mooncake.api.stats import RequestStats, percentile


def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(range(11), 90) == pytest.approx(9.0)
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)


def test_ttft_and_tbt_come_from_the_token_times():
    stats = RequestStats()
    empty = stats.snapshot()
    assert empty.ttft_p50_s is None and empty.tbt_p90_s is None and empty.num_requests == 0
    trace = stats.start(arrival=10.0)
    assert stats.snapshot().num_waiting == 1
    trace.prompt(100)
    trace.cached(64)
    for t in (10.5, 10.6, 10.8):
        trace.token(t)
    snap = stats.snapshot()
    assert (snap.num_waiting, snap.num_streaming) == (0, 1)
    trace.end("completed")
    trace.end("failed")  # a second end is ignored
    snap = stats.snapshot()
    assert snap.ttft_p50_s == pytest.approx(0.5)
    assert snap.tbt_p50_s == pytest.approx(0.15)  # gaps 0.1 and 0.2
    assert (snap.num_completed, snap.num_failed, snap.num_streaming) == (1, 0, 0)
    assert (snap.num_prompt_tokens, snap.num_cached_tokens, snap.num_generated_tokens) == (
        100,
        64,
        3,
    )


def test_outcomes_are_counted_apart_and_the_window_keeps_the_newest():
    stats = RequestStats(window_requests=3, window_gaps=2)
    for i, outcome in enumerate(["completed"] * 5 + ["rejected", "refused", "cancelled"]):
        trace = stats.start(arrival=0.0)
        if outcome == "completed":
            trace.token(float(i))
            trace.token(float(i) + 0.01 * i)
        if outcome == "refused":
            trace.refuse(400)
            trace.end("failed")  # ignored: refused already ended it
        else:
            trace.end(outcome)  # type: ignore[arg-type]
    snap = stats.snapshot()
    assert snap.num_requests == 7, "a refused request is not counted as received"
    assert snap.num_waiting == 0
    assert (snap.num_completed, snap.num_rejected, snap.num_refused, snap.num_cancelled) == (
        5,
        1,
        1,
        1,
    )
    assert (snap.window_requests, snap.window_gaps) == (3, 2)
    assert snap.ttft_p50_s == 3.0  # TTFTs 2, 3, 4 remain of 0..4
    assert snap.tbt_p50_s == pytest.approx(0.035)  # gaps 0.03 and 0.04 remain


def test_prometheus_metrics_mirror_the_counts_and_register_once():
    registry = CollectorRegistry()
    stats = RequestStats()
    stats.register_metrics(registry)
    stats.register_metrics(registry)  # a no-op, not a duplicate-metric error
    trace = stats.start(arrival=0.0)
    trace.token(0.2)
    trace.token(0.25)
    trace.end("completed")
    stats.start().end("rejected")
    value = registry.get_sample_value
    assert value("mooncake_api_requests_total", {"outcome": "completed"}) == 1
    assert value("mooncake_api_requests_total", {"outcome": "rejected"}) == 1
    assert value("mooncake_api_requests_total", {"outcome": "failed"}) == 0
    assert value("mooncake_api_ttft_seconds_count") == 1
    assert value("mooncake_api_ttft_seconds_bucket", {"le": "0.25"}) == 1
    assert value("mooncake_api_tbt_seconds_bucket", {"le": "0.05"}) == 1
    assert value("mooncake_api_generated_tokens_total") == 2
    assert value("mooncake_api_requests_in_flight") == 0
