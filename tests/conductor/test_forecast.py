"""The §7.4 decode forecast: measured decode times, the pool forecast a TTFT ahead, its own
error, and the refreshed per-instance forecast when a prefill is about to start.

Toy decode step (tests/conductor/toy.py): 10 ms + 1 ms per request + 1 us per KV token;
decode instances hold 10,000 tokens; prefill takes 1 ms per token.
"""

import numpy as np
import pytest

from mooncake.conductor import ScheduleRequest
from mooncake.conductor.forecast import DecodeForecast, DecodeTimes, ForecastError
from tests.conductor.toy import toy_conductor


def _two_modes() -> DecodeTimes:
    """Half the requests decode for 4 s, half for 12.8 s (grid step 0.2 s: exact points)."""
    times = DecodeTimes(prior_s=10.0, ewma=0.02)
    for _ in range(16):
        times.add(4.0)
        times.add(12.8)
    return times


def test_before_enough_measurements_every_request_decodes_for_t_d():
    times = DecodeTimes(prior_s=10.0, ewma=0.5, min_samples=4)
    assert (times.survival(9.9), times.survival(10.0)) == (1.0, 0.0)
    assert times.residual(4.0) == pytest.approx(0.6)  # 1 - 4/10
    assert times.mean_survival(20.0) == pytest.approx(0.5)  # landed over 20 s: half left
    times.add(6.0)  # the first measurement replaces the prior, the second counts half
    times.add(8.0)
    assert times.mean_s == pytest.approx(7.0) and times.survival(6.9) == 1.0


def test_measured_decode_times_give_survival_and_residual_life():
    times = _two_modes()
    assert times.mean_s == pytest.approx(8.4)
    assert (times.survival(3.8), times.survival(4.0), times.survival(12.8)) == (1.0, 0.5, 0.0)
    # of the KV decoding now, the share still decoding 4 s later: E[max(D - 4, 0)] / E[D]
    assert times.residual(4.0) == pytest.approx(8.8 / 2 / 8.4)
    assert times.mean_survival(8.0) == pytest.approx((4.0 + 8.0) / 2 / 8.0)


def test_a_request_that_outlived_the_short_mode_is_predicted_to_stay():
    """The uniform t_d would predict both gone or both staying; their ages tell them apart."""
    stay = _two_modes().still_decoding(np.array([2.0, 6.0, 20.0]), 2.0)
    # 2 s old: half of such requests end at 4 s; 6 s old: a long one, still there at 8 s;
    # older than anything measured: nothing says when it ends
    assert stay.tolist() == pytest.approx([0.5, 1.0, 1.0])


def test_pool_forecast_by_hand():
    # t_d = 10 s (prior). Now = 5: 4 requests holding 2,000 tokens decode, each adding 2
    # tokens a second. Prefills end at 3 (overdue: 100 tokens), 7 (300) and 20 (400).
    f = DecodeForecast(decode_time_s=10.0, ewma=0.5)
    f.gen_per_s = 2.0
    f.add_prefilling("a", 3.0, 100)
    f.add_prefilling("b", 7.0, 300)
    f.add_prefilling("c", 20.0, 400)
    n, tokens = f.at(9.0, now=5.0, running=4, running_tokens=2_000)
    # a share 1 - 4/10 of the batch is left at t=9, grown by 4 s; "a" and "b" have landed
    # (all still decoding: 4 s < t_d) with what they generated since their prefill ended
    assert n == pytest.approx(0.6 * 4 + 2)
    assert tokens == pytest.approx(0.6 * (2_000 + 4 * 2 * 4) + 400 + 2 * ((9 - 3) + (9 - 7)))
    f.prefill_ends_at("c", 8.0)  # a refreshed prediction: "c" now lands before t
    f.drop("a")
    assert f.at(9.0, now=5.0, running=0, running_tokens=0)[0] == pytest.approx(2)
    f.start_decode("b", 7.0)
    f.finish_decode("b", 11.0)  # a measured decode time of 4 s replaces the prior t_d
    assert f.decode_time_s == pytest.approx(4.0)


def test_forecast_error_scores_each_forecast_when_it_comes_due():
    e = ForecastError(weight=0.5)
    e.expect(10.0, 6_000)
    e.expect(20.0, 5_000)
    e.settle(15.0, held_tokens=5_000, capacity_tokens=10_000)  # only the first is due
    assert e.rms == pytest.approx(0.1)
    e.settle(25.0, held_tokens=8_000, capacity_tokens=10_000)  # off by 0.3: mean of squares
    assert e.rms == pytest.approx(((0.01 + 0.09) / 2) ** 0.5)


def _schedule(c, req_id: int, tokens: int, now: float):
    d = c.schedule(ScheduleRequest(req_id, tokens, [req_id]), now)
    assert d.is_accepted, d
    return d


def test_predictive_moves_the_kv_to_the_instance_with_room_when_the_prefill_starts():
    # d0 and d1 each hold a batch of 5,000 tokens (t_d = 20 s: it stays). Request 1 (3,000
    # tokens) starts on p0 at once, bound for d0 (lands at 3 s). Request 2 (1,500) was
    # placed on d1 at arrival, and so was request 3 (3,500), which starts on p2 at once
    # (lands at 3.5 s). When request 2 starts at 1 s and lands at 4 s, d1 would hold
    # 5,000 + 3,500 + 1,500 = 10,000 tokens and d0 9,500: its KV goes to d0.
    c = toy_conductor(3, 2, rejection="predictive")
    for i in range(2):
        c.decode[i].reserve(f"batch{i}", 5_000)
        c.decode[i].activate(f"batch{i}", 0.0)
    assert _schedule(c, 1, 3_000, 0.0).decode == "d0"
    assert c.admit_prefill(1, 0.0).decode == "d0"
    assert _schedule(c, 2, 1_500, 0.0).decode == "d1"
    assert _schedule(c, 3, 3_500, 0.0).decode == "d1"
    assert c.admit_prefill(3, 0.0).decode_load == pytest.approx(0.85)
    grant = c.admit_prefill(2, 1.0, prefill_s=3.0)
    assert (grant.is_accepted, grant.decode, grant.decode_load) == (True, "d0", 0.95)
    assert 2 in c.decode[0].reserved and 2 not in c.decode[1].reserved
    assert c.decode[0].incoming == {1: 3.0, 2: 4.0}


def test_predictive_rejects_at_prefill_start_what_the_arrival_forecast_let_through():
    # A batch of 7,000 tokens decodes since t=0 (t_d = 20 s). At arrival the pool forecast
    # knows no ages: a share 1 - 4.5/20 of the batch is left when request 2 lands at 4.5 s,
    # 5,425 + 2,500 (request 1) + 2,000 = 9,925 tokens: admitted. When its prefill starts
    # at 2.5 s the batch is known to be 2.5 s old: it stays, and 7,000 + 2,500 + 2,000 =
    # 11,500 tokens would not fit: rejected, before any prefill is spent.
    c = toy_conductor(1, 1, rejection="predictive")
    c.decode[0].reserve("batch", 7_000)
    c.decode[0].activate("batch", 0.0)
    _schedule(c, 1, 2_500, 0.0)
    assert _schedule(c, 2, 2_000, 0.0).decode_load == pytest.approx(0.9925)
    assert c.admit_prefill(1, 0.0).is_accepted
    c.on_prefill_finished(1, 2.5)
    grant = c.admit_prefill(2, 2.5)
    assert (grant.is_accepted, grant.reason, grant.decode_load) == (False, "decode_load", 1.15)
    assert c.num_inflight == 1 and 2 not in c.decode[0].reserved
    assert c.prefill[0].queue_time(2.5) == 0.0
    assert c.admit_prefill(2, 2.5).reason == "unknown_request"


def _two_batches_and_three_requests(c) -> None:
    """The scene of the test above, up to request 2's prefill start."""
    for i in range(2):
        c.decode[i].reserve(f"batch{i}", 5_000)
        c.decode[i].activate(f"batch{i}", 0.0)
    _schedule(c, 1, 3_000, 0.0)
    c.admit_prefill(1, 0.0)
    assert _schedule(c, 2, 1_500, 0.0).decode == "d1"
    _schedule(c, 3, 3_500, 0.0)
    c.admit_prefill(3, 0.0)


def test_late_binding_moves_the_kv_in_every_mode_and_only_predictive_rejects_at_start():
    """Late binding is placement, not rejection: none and basic move request 2's KV to d0
    as predictive does, and none of them rejects a request whose best load is under 1."""
    for mode in ("none", "basic", "predictive"):
        c = toy_conductor(3, 2, rejection=mode)
        _two_batches_and_three_requests(c)
        grant = c.admit_prefill(2, 1.0, prefill_s=3.0)
        assert (grant.is_accepted, grant.decode, grant.decode_load) == (True, "d0", 0.95), mode
        assert 2 in c.decode[0].reserved and c.decode[0].incoming[2] == 4.0, mode
        assert 2 not in c.decode[1].reserved and c.decode[1].reserved_tokens == 3_500, mode


def test_without_late_binding_other_modes_start_every_prefill_where_it_was_placed():
    for mode in ("none", "basic"):
        c = toy_conductor(3, 2, rejection=mode, late_binding=False)
        _two_batches_and_three_requests(c)
        grant = c.admit_prefill(2, 1.0, prefill_s=3.0)
        assert (grant.is_accepted, grant.decode) == (True, "d1"), mode
        assert c.prefill[1].running == 2 and c.decode[1].incoming[2] == 4.0, mode
    # predictive re-chooses at prefill start whatever the setting: its check needs it
    c = toy_conductor(3, 2, rejection="predictive", late_binding=False)
    _two_batches_and_three_requests(c)
    assert c.admit_prefill(2, 1.0, prefill_s=3.0).decode == "d0"


def test_none_and_basic_start_a_prefill_whose_decode_load_is_over_1():
    """The decode instance, not the Conductor, refuses it later in these modes."""
    for mode in ("none", "basic"):
        c = toy_conductor(1, 1, rejection=mode)
        c.decode[0].reserve("batch", 7_000)
        c.decode[0].activate("batch", 0.0)
        _schedule(c, 1, 2_500, 0.0)
        _schedule(c, 2, 2_000, 0.0)
        c.admit_prefill(1, 0.0)
        c.on_prefill_finished(1, 2.5)
        grant = c.admit_prefill(2, 2.5)
        assert (grant.is_accepted, grant.decode_load) == (True, pytest.approx(1.15)), mode
        assert c.prefill[0].running == 2, mode
