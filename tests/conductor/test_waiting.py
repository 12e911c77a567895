"""The waiting room (`scheduler.defer_s`): who waits, for how long, in what order.

Toy cost (tests/conductor/toy.py): 1 ms of prefill per prompt token, no reuse here.
"""

import math

import pytest

from mooncake.conductor import ScheduleRequest
from tests.conductor.toy import toy_conductor


def _req(req_id: int, tokens: int) -> ScheduleRequest:
    return ScheduleRequest(
        req_id, tokens, list(range(req_id * 1000, req_id * 1000 + tokens // 100))
    )


def test_a_request_refused_for_the_queue_alone_may_wait_and_runs_only_on_an_idle_group():
    # TTFT SLO 1 s; p0 and p1 each hold 0.8 s of queued prefill
    c = toy_conductor(2, 1, ttft_slo_s=1.0, defer_s=5.0)
    for rid in (1, 2):
        assert c.schedule(_req(rid, 800), now=0.0).is_accepted
    d = c.schedule(_req(3, 500), now=0.0)  # 0.8 + 0.5 s: over the SLO for the queue alone
    assert (d.is_accepted, d.reason, d.can_wait) == (False, "ttft_slo", True)
    # a prompt over the SLO on its own would miss it anywhere: refused, never waits
    long = c.schedule(_req(4, 1_200), now=0.0)
    assert (long.is_accepted, long.can_wait) == (False, False)
    # offered again: p0 has run 0.5 of its 0.8 s; 0.3 + 0.5 s would meet the SLO, but a
    # waiting request takes only a group with nothing queued, and books nothing until then
    c.on_prefill_started(1, 0.0)
    c.on_prefill_started(2, 0.0)
    again = c.schedule(_req(3, 500), now=0.5, waited=True)
    assert (again.is_accepted, again.can_wait) == (False, True)
    assert c.num_inflight == 2
    c.on_prefill_finished(2, 0.6)  # p1 is idle early (p0 has 0.2 s left): it goes there
    placed = c.schedule(_req(3, 500), now=0.6, waited=True)
    assert placed.is_accepted and placed.prefill == "p1" and not placed.can_wait
    assert placed.ttft_s == pytest.approx(0.5) and c.num_inflight == 3
    c.check_integrity()


def test_without_defer_s_a_request_refused_for_the_queue_never_waits():
    c = toy_conductor(1, 1, ttft_slo_s=1.0)
    assert c.schedule(_req(1, 800), now=0.0).is_accepted
    d = c.schedule(_req(2, 500), now=0.0)
    assert (d.is_accepted, d.reason, d.can_wait) == (False, "ttft_slo", False)


def test_a_request_waits_only_while_the_offered_load_fits():
    # one group; the offered load decays over 2 s
    c = toy_conductor(1, 1, ttft_slo_s=1.0, defer_s=5.0, defer_window_s=2.0)
    assert c.schedule(_req(1, 800), now=0.0).is_accepted
    assert c.schedule(_req(2, 500), now=0.0).can_wait  # (0.8 + 0.5) / 2 = 0.65 offered
    # 2.1 s of first-stage work over a 2 s window: sustained overload, refused at once
    late = c.schedule(_req(3, 800), now=0.0)
    assert (late.is_accepted, late.can_wait) == (False, False)
    assert c.offered_load(0.0) == pytest.approx(1.05)
    assert 3 not in c.waiting and 2 in c.waiting
    # once in, it waits on whatever the load does next, and goes when the group is idle
    c.on_prefill_started(1, 0.0)
    c.on_prefill_finished(1, 0.1)
    d = c.schedule(_req(2, 500), now=0.1, waited=True)
    assert d.is_accepted and c.offered_load(0.1) == pytest.approx(2.1 * math.exp(-0.05) / 2)
    assert 2 not in c.waiting


def test_a_request_not_predicted_to_start_within_defer_s_is_refused_at_once():
    # one group, 0.8 s queued; a 1 s wait: the first 0.5 s prompt starts at 0.8, the
    # second would start at 1.3, after its wait: refused now, not after 1 s
    c = toy_conductor(1, 1, ttft_slo_s=1.0, defer_s=1.0, defer_window_s=100.0)
    assert c.schedule(_req(1, 800), now=0.0).is_accepted
    first = c.schedule(_req(2, 500), now=0.0)
    assert first.can_wait and first.wait_s == pytest.approx(0.8)  # when the group is idle
    second = c.schedule(_req(3, 500), now=0.0)
    assert (second.is_accepted, second.reason, second.can_wait) == (False, "ttft_slo", False)
    assert len(c.waiting) == 1


def test_waiting_requests_are_placed_oldest_first_and_leave_when_refused():
    c = toy_conductor(1, 1, ttft_slo_s=1.0, defer_s=5.0, defer_window_s=100.0)
    assert c.schedule(_req(1, 800), now=0.0).is_accepted
    assert c.schedule(_req(2, 500), now=0.0).can_wait
    assert c.schedule(_req(3, 400), now=0.0).can_wait
    c.on_prefill_started(1, 0.0)
    c.on_prefill_finished(1, 0.8)
    # the group is idle: the younger one, offered first, is not its turn
    younger = c.schedule(_req(3, 400), now=0.8, waited=True)
    assert (younger.is_accepted, younger.can_wait) == (False, True)
    assert c.schedule(_req(2, 500), now=0.8, waited=True).is_accepted
    # the group holds request 2 for 0.5 s: the younger one is told to try again then
    again = c.schedule(_req(3, 400), now=0.8, waited=True)
    assert again.can_wait and again.wait_s == pytest.approx(0.5)
    c.end_wait(3)  # its wait ended unplaced (the master's or the simulator's word)
    gone = c.schedule(_req(3, 400), now=0.9, waited=True)
    assert (gone.is_accepted, gone.can_wait) == (False, False)
    assert len(c.waiting) == 0
    c.check_integrity()


def test_a_waiter_nobody_ends_is_dropped_after_its_wait_and_a_grace():
    c = toy_conductor(1, 1, ttft_slo_s=1.0, defer_s=2.0, defer_window_s=100.0)
    assert c.schedule(_req(1, 800), now=0.0).is_accepted
    assert c.schedule(_req(2, 500), now=0.0).can_wait
    assert c.schedule(_req(2, 500), now=2.5, waited=True).can_wait  # within the 1 s grace
    assert len(c.waiting) == 1
    dropped = c.schedule(_req(2, 500), now=3.5, waited=True)
    assert (dropped.is_accepted, dropped.can_wait, len(c.waiting)) == (False, False, 0)
