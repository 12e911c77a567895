"""Early rejection: none / basic (§7.2) / predictive (§7.4), and the decode-side check.

Toy decode step (tests/conductor/toy.py): 10 ms + 1 ms per request + 1 us per KV token.
"""

import pytest

from mooncake.conductor import ScheduleRequest
from mooncake.conductor.admission import decode_can_admit, predicted_decode_load
from mooncake.conductor.load import PrefillQueue
from tests.conductor.toy import toy_conductor, toy_cost


def _req(req_id: int, tokens: int) -> ScheduleRequest:
    return ScheduleRequest(
        req_id, tokens, list(range(req_id * 1000, req_id * 1000 + tokens // 100))
    )


def test_ttft_over_slo_is_rejected_before_prefill_in_every_mode():
    for mode in ("none", "basic", "predictive"):
        c = toy_conductor(1, 1, rejection=mode, ttft_slo_s=0.5)
        d = c.schedule(_req(1, 600), now=0.0)  # 0.6 s of prefill
        assert (d.is_accepted, d.reason) == (False, "ttft_slo")
        assert d.prefill_load == pytest.approx(1.2)
        assert c.num_inflight == 0  # a rejection leaves no load behind


def _fill_decode(c, tokens: int) -> None:
    c.decode[0].reserve("old", tokens)
    c.decode[0].activate("old", 0.0)


def test_basic_rejects_on_the_current_decode_load_none_does_not():
    # decode holds 9,500 of 10,000 tokens; a 600-token request would overflow its KV room
    for mode, accepted in (("none", True), ("basic", False)):
        c = toy_conductor(1, 1, rejection=mode)
        _fill_decode(c, 9_500)
        d = c.schedule(_req(1, 600), now=0.0)
        assert d.is_accepted is accepted, mode
        if not accepted:
            assert d.reason == "decode_load" and d.decode_load == pytest.approx(10_100 / 10_000)


def test_basic_ignores_requests_still_in_prefill_predictive_does_not():
    # 9,000 tokens are in prefill, due at decode in 1 s: basic admits, predictive rejects
    for mode, accepted in (("basic", True), ("predictive", False)):
        c = toy_conductor(1, 1, rejection=mode)
        c.decode[0].reserve("incoming", 9_000)
        c.forecast.add_prefilling("incoming", 1.0, 9_000)
        d = c.schedule(_req(1, 1_500), now=0.0)
        assert d.is_accepted is accepted, mode


def test_predicted_load_by_hand():
    # 2 decode instances of 10,000 tokens, t_d = 20 s (the prior: nothing measured yet).
    # At now = 5, 2 requests holding 600 tokens decode; a prefill of 300 tokens ends at 8.
    # At t = 10 (h = 5 s): a share 1 - 5/20 = 0.75 of the batch remains (1.5 requests, 450
    # tokens), the 300-token request has landed and decodes; the new one adds 1 and 1,500:
    # per instance 1.75 requests and 1,125 tokens: TBT = 10 + 1.75 + 1.125 = 12.875 ms.
    c = toy_conductor(1, 2, rejection="predictive")
    c.forecast.add_prefilling("c", 8.0, 300)
    load = predicted_decode_load(
        c.cost, c.params, c.forecast, 2, (2, 600.0), 1_500, now=5.0, t=10.0
    )
    assert load == pytest.approx(0.12875)


def _decoding(c, req_id: int, tokens: int, start: float) -> None:
    """Run a request through prefill on the toy conductor; it decodes from `start`."""
    assert c.schedule(_req(req_id, tokens), now=start - tokens / 1000).is_accepted
    c.on_prefill_started(req_id, start - tokens / 1000)
    c.on_prefill_finished(req_id, start)
    c.on_decode_started(req_id, start)


def test_decode_load_counts_the_kv_the_batch_has_generated():
    # a request of 4,000 prompt tokens decodes from t=4; at t=5 its instance reports 4,100
    # tokens of KV and a 10 ms step (100 tokens/s); the Conductor extrapolates from there
    c = toy_conductor(1, 1, rejection="basic")
    _decoding(c, 1, 4_000, start=4.0)
    c.on_decode_report("d0", kv_tokens=4_100, batch_size=1, step_s=0.01, now=5.0)
    assert c.decode[0].held_tokens(5.5) == pytest.approx(4_150)
    assert c.forecast.gen_per_s == pytest.approx(100.0)
    # basic at t=5: (4,100 + 5,950) tokens > 10,000 of room, though the prompts alone fit
    d = c.schedule(_req(2, 5_950), now=5.0)
    assert (d.reason, d.decode_load) == ("decode_load", pytest.approx(10_050 / 10_000))


def test_predictive_load_by_hand_through_schedule():
    # t=5: request 1 (4,000 tokens) decodes since t=4 and its instance reports 4,100 tokens
    # of KV, 100 tokens/s. Request 2 (3,000 tokens) is admitted: no queue, 3 s of prefill,
    # it lands at t=8. Request 3 (4,000 tokens) waits 3 s and prefills 4 s: it lands at
    # t=12 (h = 7 s). With t_d = 20 s a share 1 - 7/20 = 0.65 of the batch is left then:
    # 0.65 * (4,100 + 100 * 7) = 3,120 tokens; request 2 holds 3,000 + 100 * 4 = 3,400;
    # request 3 adds 4,000: 10,520 of 10,000 tokens -> load 1.052, rejected. Basic sees
    # only the batch now: 4,100 + 4,000 tokens -> 0.81; it admits.
    for mode, accepted, load in (("predictive", False, 1.052), ("basic", True, 0.81)):
        c = toy_conductor(1, 1, rejection=mode)
        _decoding(c, 1, 4_000, start=4.0)
        c.on_decode_report("d0", kv_tokens=4_100, batch_size=1, step_s=0.01, now=5.0)
        assert c.schedule(_req(2, 3_000), now=5.0).is_accepted
        d = c.schedule(_req(3, 4_000), now=5.0)
        assert d.ttft_s == pytest.approx(7.0)
        assert (d.is_accepted, d.decode_load) == (accepted, pytest.approx(load)), mode
        c.check_integrity()


def test_decode_side_admission():
    cost = toy_cost()
    assert decode_can_admit(
        cost, 0.1, batch_size=3, context_tokens=9_000, input_len=1_000, capacity_tokens=10_000
    )
    assert not decode_can_admit(cost, 0.1, 3, 9_001, 1_000, 10_000)  # KV does not fit
    assert not decode_can_admit(cost, 0.014, 3, 100, 1_000, 10_000)  # 10+4+1.1 ms > 14 ms


def test_prefill_queue_time_counts_down_the_running_request():
    q = PrefillQueue("p0", 1)
    q.add("a", 4.0)
    q.add("b", 2.0)
    assert q.queue_time(0.0) == 6.0
    q.start("a", now=1.0)
    assert q.queue_time(2.0) == pytest.approx(5.0)
    assert q.queue_time(9.0) == pytest.approx(2.0)  # overdue: the running one counts as done
    q.finish("a")
    assert q.queue_time(9.0) == 2.0
