"""The Conductor prices a prefill on a pipeline group as the group runs it: a request's
latency is T/S * (C + S - 1)/C, and the queue drains at T/S per queued request."""

import pytest

from mooncake.conductor import ScheduleRequest
from mooncake.conductor.pipelining import (
    inflight_bound,
    num_chunks,
    pipeline_times,
    stream_tail_s,
)
from tests.conductor.toy import toy_conductor


def test_pipeline_times_by_hand():
    assert num_chunks(1000, 100) == 10 and num_chunks(1001, 100) == 11
    assert num_chunks(50, 100) == num_chunks(0, 100) == num_chunks(500, 0) == 1
    assert pipeline_times(1.0, 10, 1) == (1.0, 1.0)
    stage, latency = pipeline_times(1.0, 10, 2)
    assert (stage, latency) == (pytest.approx(0.5), pytest.approx(0.55))
    assert stream_tail_s(1000, 4, 1000.0) == pytest.approx(0.25)  # one layer of 4


def test_a_two_stage_group_queue_drains_at_half_the_prefill_time():
    c = toy_conductor(1, 1, stages=2, chunk_tokens=100)
    first = c.schedule(ScheduleRequest(1, 1000, [1]), now=0.0)  # 1 s on the whole model
    assert first.ttft_s == pytest.approx(0.55)  # 0.5 * (10 + 1) / 10
    assert c.prefill[0].queue_time(0.0) == pytest.approx(0.5)  # not 1 s
    second = c.schedule(ScheduleRequest(2, 1000, [2]), now=0.0)
    assert second.ttft_s == pytest.approx(0.5 + 0.55)
    c.on_prefill_started(1, 0.0)
    assert c.prefill[0].queue_time(0.2) == pytest.approx(0.8)
    c.on_prefill_started(2, 0.5)  # request 1 left the first stage
    assert c.prefill[0].queue_time(0.5) == pytest.approx(0.5)
    c.check_integrity()
    c.on_prefill_finished(1, 0.55)
    c.on_prefill_finished(2, 1.05)
    assert c.prefill[0].queue_time(1.05) == 0.0
    c.check_integrity()


def test_one_stage_prices_are_unchanged():
    c = toy_conductor(1, 1, chunk_tokens=100)
    c.schedule(ScheduleRequest(1, 1000, [1]), now=0.0)
    d = c.schedule(ScheduleRequest(2, 1000, [2]), now=0.0)
    assert d.ttft_s == pytest.approx(2.0)


def test_the_in_flight_gain_shrinks_as_prompts_have_more_chunks():
    # 4 prompts on 2 stages: 4 x (C + 1) chunk-stage times against 4 C + 1
    assert inflight_bound(4, 1, 2) == pytest.approx(8 / 5)
    assert inflight_bound(4, 4, 2) == pytest.approx(20 / 17)
    assert inflight_bound(4, 16, 2) == pytest.approx(68 / 65)
    assert inflight_bound(4, 4, 1) == pytest.approx(1.0)  # one stage: nothing overlaps
    assert inflight_bound(1, 4, 2) == pytest.approx(1.0)
