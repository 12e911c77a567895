"""A prefill leader's TaskQueue (roles/tasks.py): an abort skips a task still waiting,
never one already taken, and leaves nothing behind, with puts, aborts and takes racing
on three threads as the RPC thread, the worker and the completer do."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from mooncake.engine.params import SamplingParams
from mooncake.roles.messages import PrefillTaskMsg
from mooncake.roles.tasks import TaskQueue

pytestmark = pytest.mark.timeout(60)


def _task(req_id: int) -> PrefillTaskMsg:
    return PrefillTaskMsg(req_id, [1, 2, 3], SamplingParams(max_tokens=1), "d", "tcp://d:1")


def test_an_abort_skips_only_a_waiting_task() -> None:
    q = TaskQueue()
    for i in range(3):
        q.put(_task(i))
    assert q.abort(1) and not q.abort(9)
    first = q.get()
    assert first is not None and first.req_id == 0
    assert not q.abort(0)  # taken: too late to skip
    q.close()
    rest = [q.get(), q.get()]
    assert [t.req_id if t else None for t in rest] == [2, None]
    assert q.num_skips == 0 and q.qsize() == 0


def test_racing_puts_aborts_and_takes_lose_nothing_and_leave_no_skip_behind() -> None:
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
    assert q.num_skips == 0  # every abort was consumed by its task
    assert not set(aborted) & set(taken)  # an accepted abort always skipped its task
    assert len(taken) + len(set(aborted)) == n  # every task was taken or skipped
