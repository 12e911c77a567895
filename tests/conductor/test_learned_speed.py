"""A prefill queue learns its group's real speed from finished prefills: a group that
runs at half the cost model's speed is soon priced at half speed; dropped requests and a
fixed setting (speed_ewma 0) teach nothing."""

import pytest

from mooncake.conductor.load import PrefillQueue


def _run(q: PrefillQueue, n: int, observed_s: float, predicted_s: float = 1.0) -> None:
    t = 0.0
    for i in range(n):
        q.add(i, predicted_s)
        q.start(i, t)
        t += observed_s
        q.finish(i, t)


def test_a_slow_group_is_priced_at_its_observed_speed() -> None:
    q = PrefillQueue("p0", 0, speed_ewma=0.2)
    _run(q, 30, observed_s=2.0)
    assert q.speed == pytest.approx(2.0, rel=0.01)
    q.add("next", 1.0)
    assert q.queue_time(0.0) == pytest.approx(2.0, rel=0.01)


def test_a_pipeline_group_learns_from_its_latency_not_its_stage_time() -> None:
    """2 stages, 4 chunks: a 1 s prefill is predicted to end 0.5 * 5/4 s after its start;
    finishing exactly then teaches speed 1."""
    q = PrefillQueue("p0", 0, stages=2, chunk_tokens=100, speed_ewma=0.5)
    q.add("a", 1.0, new_tokens=400)
    q.start("a", 0.0)
    q.finish("a", 0.625)
    assert q.speed == pytest.approx(1.0)


def test_dropped_requests_and_a_fixed_setting_teach_nothing() -> None:
    q = PrefillQueue("p0", 0, speed_ewma=0.2)
    q.add("a", 1.0)
    q.start("a", 0.0)
    q.finish("a")  # dropped
    assert q.speed == 1.0
    fixed = PrefillQueue("p1", 1, speed_ewma=0.0)
    _run(fixed, 5, observed_s=3.0)
    assert fixed.speed == 1.0
