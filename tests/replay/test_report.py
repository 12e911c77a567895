"""The report on hand-made records: counts, exact percentiles, SLO attainment, rates."""

from typing import Any

import pytest

from mooncake.replay.report import RequestRecord, RunInfo, meets_slo, summarize

INFO = RunInfo(
    url="http://h:1",
    model="m",
    ttft_slo_s=1.0,
    tbt_slo_s=0.1,
    block_tokens=32,
    scale=0.0625,
    output_scale=0.0625,
    speed=1.0,
    vocab_size=512,
    prompt_format="tokens",
)


def _ok(i: int, ttft: float, gaps: list[float], **kw: Any) -> RequestRecord:
    fields: dict[str, Any] = dict(
        send_s=0.0, end_s=10.0, prompt_tokens=100, expected_output_tokens=len(gaps) + 1
    )
    fields.update(kw)
    return RequestRecord(
        index=i, status="ok", ttft_s=ttft, gaps_s=gaps, output_tokens=len(gaps) + 1, **fields
    )


def test_percentiles_are_exact_on_101_evenly_spaced_values():
    # TTFTs 0.00, 0.01, ..., 1.00 s: p50 = 0.50, p90 = 0.90, p99 = 0.99 exactly (rank q).
    recs = [_ok(i, i / 100, [0.01 * (i + 1)]) for i in range(101)]
    r = summarize(recs, INFO)
    assert (r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s) == pytest.approx((0.5, 0.9, 0.99))
    assert (r.tbt_p50_s, r.tbt_p90_s, r.tbt_p99_s) == pytest.approx((0.51, 0.91, 1.0))
    assert r.sent == r.completed == 101 and r.rejected == r.failed == 0


def test_tbt_percentiles_pool_every_gap_of_every_request():
    # 9 gaps of 10 ms in one request and one gap of 1 s in another: the pool has 10 gaps.
    r = summarize([_ok(0, 0.1, [0.01] * 9), _ok(1, 0.1, [1.0])], INFO)
    assert r.tbt_p50_s == pytest.approx(0.01)
    assert r.tbt_p90_s == pytest.approx(0.01 + 0.1 * (1.0 - 0.01))  # between rank 8 and 9
    assert r.output_tokens == 10 + 2


def test_attainment_needs_ttft_and_the_requests_own_p90_tbt_and_counts_misses():
    fast = _ok(0, 0.5, [0.05] * 10)
    slow_first = _ok(1, 1.5, [0.05] * 10)
    # P90 of [0.05 x 8, 0.1, 0.1] is 0.1: at the SLO, which meets it (<=).
    two_slow_gaps = _ok(2, 0.5, [0.05] * 8 + [0.1, 0.1])
    # One gap over the SLO in ten pushes the P90 to 0.05 + 0.1 * 0.95 = 0.145: a miss.
    one_bad_gap = _ok(3, 0.5, [0.05] * 9 + [1.0])
    one_token = _ok(4, 0.9, [])  # no gaps: the TBT part holds
    rejected = RequestRecord(index=5, status="rejected", send_s=0, end_s=0.1, error="HTTP 429: x")
    failed = RequestRecord(index=6, status="error", send_s=0, end_s=0.1, error="cannot connect")
    recs = [fast, slow_first, two_slow_gaps, one_bad_gap, one_token, rejected, failed]
    assert [meets_slo(r, 1.0, 0.1) for r in recs] == [True, False, True, False, True, False, False]
    r = summarize(recs, INFO)
    assert r.slo_attainment == pytest.approx(3 / 7)
    # goodput counts only the output of the three that met both SLOs: 11 + 11 + 1 tokens
    assert r.output_tokens == 11 * 4 + 1
    assert r.goodput_tokens_per_s == pytest.approx((11 + 11 + 1) / r.duration_s)
    assert (r.sent, r.completed, r.rejected, r.failed) == (7, 5, 1, 1)
    assert r.errors == {"HTTP 429: x": 1, "cannot connect": 1}


def test_throughput_cache_share_and_short_outputs():
    a = _ok(0, 0.2, [0.1] * 3, send_s=1.0, end_s=3.0, cached_tokens=64, prompt_tokens=128)
    b = _ok(1, 0.2, [0.1] * 5, send_s=2.0, end_s=5.0, expected_output_tokens=10)
    c = _ok(2, 0.2, [], send_s=2.0, end_s=4.0, cached_tokens=0, prompt_tokens=64)
    r = summarize([a, b, c], INFO)
    assert r.duration_s == pytest.approx(4.0)  # first send (1 s) to last end (5 s)
    assert r.output_tokens == 4 + 6 + 1
    assert r.output_tokens_per_s == pytest.approx(11 / 4)
    assert r.request_throughput_rps == pytest.approx(3 / 4)
    # Only requests whose usage told cached tokens count: 64 of 128 + 64 prompt tokens.
    assert r.cached_token_share == pytest.approx(64 / 192)
    assert r.short_outputs == 1  # b asked for 10 and got 6
    assert r.block_tokens == 32


def test_nothing_completed_gives_none_percentiles_and_no_cache_share():
    r = summarize([RequestRecord(index=0, status="rejected", send_s=0, end_s=0)], INFO)
    assert r.ttft_p50_s is None and r.tbt_p99_s is None and r.cached_token_share is None
    assert r.slo_attainment == 0.0 and r.errors == {"rejected": 1}


def test_blocks_by_cause_sum_over_the_completed_requests_that_told_them():
    """A server that attributes its misses (usage.prompt_tokens_details.kv_blocks): the
    report sums them and gives each as a share of the blocks requested; none told: {}."""
    a = _ok(0, 0.2, [], kv_blocks={"requested": 10, "hit": 6, "cold": 4})
    b = _ok(1, 0.2, [], kv_blocks={"requested": 30, "hit": 24, "evicted": 5, "elsewhere": 1})
    c = _ok(2, 0.2, [])  # a server that does not attribute
    lost = RequestRecord(index=3, status="error", send_s=0, end_s=1, kv_blocks={"requested": 9})
    r = summarize([a, b, c, lost], INFO)
    assert r.kv_blocks == {"requested": 40, "hit": 30, "cold": 4, "evicted": 5, "elsewhere": 1}
    assert r.kv_block_shares["hit"] == pytest.approx(0.75)
    assert r.kv_block_shares["evicted"] == pytest.approx(5 / 40)
    assert summarize([c], INFO).kv_blocks == {} == summarize([c], INFO).kv_block_shares
