"""A prefill group leader's tasks waiting to begin, in the Conductor's order.

The master numbers requests as it places them (a lower request id was placed first), and
the Conductor's queue-time estimate for a group assumes the group takes them in that
order. Their dispatch RPCs race on the way (one coroutine per HTTP request, a connection
still forming), so tasks may arrive out of order: the queue hands out the lowest id
waiting, not the first to arrive. A task taken back for another try (its id unchanged)
goes ahead of later ones, as it should.

Thread-safe: the RPC thread puts and aborts, the worker thread takes.
"""

from __future__ import annotations

import heapq
import threading

from mooncake.roles.node.messages import PrefillTaskMsg


class TaskQueue:
    """Waiting tasks by request id; `abort` drops one that has not begun."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[int, PrefillTaskMsg]] = []
        self._waiting: set[int] = set()  # req ids in the heap and not aborted
        self._closed = False

    def put(self, task: PrefillTaskMsg) -> None:
        with self._cond:
            heapq.heappush(self._heap, (task.req_id, task))
            self._waiting.add(task.req_id)
            self._cond.notify()

    def get(self) -> PrefillTaskMsg | None:
        """The waiting task placed first, blocking until there is one; None once closed."""
        with self._cond:
            while True:
                while self._heap:
                    req_id, task = heapq.heappop(self._heap)
                    if req_id in self._waiting:
                        self._waiting.discard(req_id)
                        return task
                if self._closed:
                    return None
                self._cond.wait()

    def abort(self, req_id: int) -> bool:
        """Drop a task still waiting; False when it is not waiting (begun, or unknown)."""
        with self._cond:
            if req_id not in self._waiting:
                return False
            self._waiting.discard(req_id)
            return True

    def close(self) -> None:
        """Wake the taker: it gets None once the heap holds no waiting task."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def qsize(self) -> int:
        with self._cond:
            return len(self._waiting)
