"""A leader's waiting tasks: taken in the Conductor's order (request ids), whatever order
their dispatches arrived in; an abort drops only a task still waiting."""

import threading

from mooncake.engine.params import SamplingParams
from mooncake.roles.messages import PrefillTaskMsg
from mooncake.roles.taskqueue import TaskQueue


def _task(req_id: int) -> PrefillTaskMsg:
    return PrefillTaskMsg(req_id, [1, 2, 3], SamplingParams(), "d0", "tcp://127.0.0.1:1")


def test_tasks_are_taken_in_placement_order_not_arrival_order():
    q = TaskQueue()
    for rid in (104, 105, 101, 103, 102):
        q.put(_task(rid))
    assert q.qsize() == 5
    assert [q.get().req_id for _ in range(5)] == [101, 102, 103, 104, 105]  # type: ignore[union-attr]


def test_an_abort_skips_a_waiting_task_and_not_one_already_taken():
    q = TaskQueue()
    for rid in (1, 2, 3):
        q.put(_task(rid))
    first = q.get()
    assert first is not None and first.req_id == 1
    assert not q.abort(1)  # begun: cannot be skipped
    assert q.abort(2)
    assert not q.abort(2)
    assert q.qsize() == 1
    third = q.get()
    assert third is not None and third.req_id == 3


def test_close_hands_out_what_still_waits_then_none():
    q = TaskQueue()
    q.put(_task(7))
    q.close()
    task = q.get()
    assert task is not None and task.req_id == 7
    assert q.get() is None


def test_a_blocked_taker_wakes_for_a_put_and_for_close():
    q = TaskQueue()
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.extend([q.get(), q.get()]))
    taker.start()
    q.put(_task(5))
    q.close()
    taker.join(timeout=5)
    assert not taker.is_alive()
    assert [getattr(t, "req_id", None) for t in got] == [5, None]
