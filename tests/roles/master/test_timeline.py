"""The TTFT phases: each request's queue, prefill and first step, and the Conductor's
predicted TTFT against the real one."""

from prometheus_client import CollectorRegistry

from mooncake.roles.master.timeline import Moments, PhaseLog


def test_phases_add_up_to_the_ttft_and_the_ratio_compares_prediction_with_it():
    log = PhaseLog()
    registry = CollectorRegistry()
    log.register_metrics(registry)
    log.record(Moments(0, 10.0, predicted_ttft_s=1.0, started=11.0, prefilled=13.0), 14.0)
    log.record(Moments(0, 20.0, predicted_ttft_s=8.0, started=20.5, prefilled=23.5), 24.0)
    s = log.summary()
    assert s.num_requests == 2
    assert s.queue_p50_s == 0.75  # 1.0 and 0.5
    assert s.prefill_p50_s == 2.5  # 2.0 and 3.0
    assert s.first_step_p50_s == 0.75  # 1.0 and 0.5
    assert s.predicted_over_actual_p50 == (1.0 / 4.0 + 8.0 / 4.0) / 2
    count = registry.get_sample_value("mooncake_ttft_phase_seconds_count", {"phase": "queue"})
    assert count == 2
    assert registry.get_sample_value("mooncake_ttft_predicted_over_actual_count") == 2


def test_a_first_token_ahead_of_the_prefill_report_counts_prefill_up_to_it():
    log = PhaseLog()
    log.record(Moments(0, 0.0, predicted_ttft_s=1.0, started=1.0, prefilled=0.0), 3.0)
    s = log.summary()
    assert (s.queue_p50_s, s.prefill_p50_s, s.first_step_p50_s) == (1.0, 2.0, 0.0)


def test_a_request_never_started_is_not_counted():
    log = PhaseLog()
    log.record(Moments(0, 5.0, predicted_ttft_s=1.0), 6.0)
    assert log.summary().num_requests == 0
    assert log.summary().queue_p50_s is None


def test_a_report_after_the_first_token_is_recorded_once_at_its_hand_off():
    """The prefill node reports after sealing the pool objects, often after the decode
    node's first token: the request is recorded once both are in, the prefill ending at
    the hand-off (the report's arrival less the seal), in either order."""
    log = PhaseLog()
    late = Moments(0, 0.0, predicted_ttft_s=1.0, started=1.0)
    log.first_token(late, 3.0)
    assert log.summary().num_requests == 0  # waits for the report
    log.handed_off(late, 2.5)
    early = Moments(1, 0.0, predicted_ttft_s=1.0, started=1.0)
    log.handed_off(early, 2.5)
    log.first_token(early, 3.0)
    s = log.summary()
    assert s.num_requests == 2
    assert (s.queue_p50_s, s.prefill_p50_s, s.first_step_p50_s) == (1.0, 1.5, 0.5)
