"""Overload (paper §7.3-7.4) in a toy cluster small enough to reason about by hand.

1 prefill + 1 decode instance. Every request has 1,000 prompt tokens (prefill 1 ms a
token: 1 s) and 226 output tokens (225 decode steps of exactly 10 ms: every request
decodes for 2.25 s, so §7.4's uniform decode time t_d is exact once measured). The decode
instance's KV room, 2,700 tokens, holds two requests (each grows from 1,001 to 1,226
tokens) but never three. Requests arrive every 0.5 s (2/s); the TTFT SLO of 2.5 s lets
at most one wait behind the running prefill. So prefill could take 1 request/s while
decode finishes only 2 per 2.25 s: the decode pool is the bottleneck, and both pools are
full.
"""

import pytest

from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import load_trace
from tests.sim.toy import write_toy_cost, write_trace

NUM = 80


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    cost = write_toy_cost(
        tmp / "cost.json", kv_capacity_tokens=2_700, step_per_request_s=0, step_per_token_s=0
    )
    rows = [(500 * i, 1000, 226, [2 * i, 2 * i + 1]) for i in range(NUM)]
    records = load_trace(write_trace(tmp / "t.jsonl", rows))
    out = {}
    for mode in ("none", "basic", "predictive"):
        cfg = SimConfig(
            num_prefill=1,
            num_decode=1,
            rejection=mode,
            ttft_slo_s=2.5,
            cost_model_path=cost,
            reserve_at_start=False,  # the paper's §7 path: decode checks when the KV lands
        )
        sim = Simulator(cfg, records)
        out[mode] = (sim.run().result, sim)
        sim.conductor.check_integrity()
    return out


def _pattern(sim) -> str:
    """One letter per request: o done, L rejected after prefill, s rejected when its
    prefill was about to start, T rejected at arrival for TTFT, d for decode load."""
    letter = {"done": "o", "rejected_late": "L", "rejected_start": "s"}
    return "".join(
        letter.get(r.status) or ("T" if r.decision.reason == "ttft_slo" else "d")
        for r in sim.requests
    )


def test_predictive_rejects_before_prefill_exactly_what_decode_could_not_take(runs):
    """Once t_d is measured, the check as each prefill is about to start sees the batch the
    request will meet 1 s later: decode runs two requests back to back, so 2 are admitted
    per 2.25 s, each as a slot frees, and every other request is turned away unprefilled."""
    result, sim = runs["predictive"]
    assert sim.conductor.forecast.decode_time_s == pytest.approx(2.25)
    assert (result.rejected, result.rejected_at_prefill_start) == (48, 43)
    assert result.rejected_after_prefill == 0 and result.wasted_prefill_gpu_s == 0
    assert _pattern(sim).endswith("oosss" * 14 + "oos")


def test_basic_oscillates_and_wastes_prefill(runs):
    """Basic looks at the batch decoding now: it admits while a slot is free now, though
    the request lands a TTFT later, when earlier admissions have filled the batch (late
    rejections), and rejects while the batch is full now, though it will have drained."""
    result, sim = runs["basic"]
    assert (result.rejected, result.rejected_after_prefill) == (54, 12)
    assert _pattern(sim).count("ooLoTddodLddd") == 6  # the same period, over and over


def test_rejections_ordered_predictive_below_none_and_basic(runs):
    """`none` spends prefill on requests decode then refuses, so a request that would fit
    waits behind them and decode slots idle; basic idles them more, rejecting while the
    batch is full now; `predictive` prefills only what decode takes. In this toy basic
    rejects even more than none (the paper's Table 3 has basic between the two)."""
    none, basic, pred = (runs[m][0] for m in ("none", "basic", "predictive"))
    assert none.rejected_after_prefill == 14 and none.wasted_prefill_gpu_s == 14 * 8.0
    assert (pred.rejected, none.rejected, basic.rejected) == (48, 52, 54)
    assert pred.completed > max(none.completed, basic.completed)
    for mode in ("none", "basic", "predictive"):
        assert runs[mode][0].requests == NUM


def test_the_report_breaks_rejections_down_by_when_and_why(runs):
    """Every rejection is counted once: at arrival for TTFT or decode load, when the
    prefill was about to start, or after the prefill (the only ones wasting prefill)."""
    for mode in ("none", "basic", "predictive"):
        result, sim = runs[mode]
        pattern = _pattern(sim)
        assert result.rejected_ttft_slo == pattern.count("T"), mode
        assert result.rejected_decode_load == pattern.count("d"), mode
        assert result.rejected_at_prefill_start == pattern.count("s"), mode
        assert result.rejected_after_prefill == pattern.count("L"), mode
        assert result.rejected == sum(map(pattern.count, "TdsL")), mode
    assert runs["none"][0].rejected_decode_load == 0  # none never checks decode at arrival
