"""A leader's waiting tasks: taken in the Conductor's order (request ids), whatever order
their dispatches arrived in; an abort drops only a task still waiting, also with puts,
aborts and takes racing on three threads as the RPC thread, the worker and the completer
do."""

import random
import sys
import threading

import pytest

from mooncake.model.params import SamplingParams
from mooncake.roles.node.messages import PrefillTaskMsg
from mooncake.roles.prefill.taskqueue import TaskQueue


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


@pytest.mark.timeout(60)
def test_racing_puts_aborts_and_takes_lose_nothing() -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # NOTE: interleave the threads as finely as possible
    try:
        q, n = TaskQueue(), 3000
        taken: list[int] = []
        aborted: list[int] = []

        def rpc() -> None:
            rng = random.Random(7)
            for i in range(n):
                q.put(_task(i))
                j = rng.randrange(max(0, i - 3), i + 1)
                if rng.random() < 0.5 and q.abort(j):
                    aborted.append(j)

        def abort_more() -> None:
            for i in range(n):
                if q.abort(i):
                    aborted.append(i)

        def work() -> None:
            while (t := q.get()) is not None:
                taken.append(t.req_id)

        worker = threading.Thread(target=work)
        worker.start()
        threads = [threading.Thread(target=rpc), threading.Thread(target=abort_more)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        q.close()
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert len(taken) == len(set(taken))  # each task at most once, in order
    assert taken == sorted(taken)
    assert q.qsize() == 0  # nothing left waiting
    assert not set(aborted) & set(taken)  # an accepted abort always skipped its task
    assert len(taken) + len(set(aborted)) == n  # every task was taken or skipped
