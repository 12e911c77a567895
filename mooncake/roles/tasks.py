"""A prefill leader's queue of tasks, in the Conductor's order, from which an abort skips
a task still waiting.

The RPC thread puts tasks and aborts, the worker thread takes them, the completer thread
puts one back (prefilled again with less reuse). One condition guards the queue and the
set of tasks to skip together (so an abort never lands between a task's taking and its
check, and no skip outlives its task); it is held for O(1) work per call.
"""

from __future__ import annotations

import threading
from collections import deque

from mooncake.roles.messages import PrefillTaskMsg


class TaskQueue:
    """Tasks waiting for the worker; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tasks: deque[PrefillTaskMsg] = deque()
        self._queued: set[int] = set()  # req ids in `_tasks`
        self._skip: set[int] = set()  # of those, the aborted ones
        self._is_closed = False

    def put(self, task: PrefillTaskMsg) -> None:
        with self._cond:
            self._tasks.append(task)
            self._queued.add(task.req_id)
            self._cond.notify()

    def abort(self, req_id: int) -> bool:
        """Skip the task when its turn comes; False when it is not waiting (running,
        done, or never here)."""
        with self._cond:
            if req_id not in self._queued:
                return False
            self._skip.add(req_id)
            return True

    def get(self) -> PrefillTaskMsg | None:
        """The next task not aborted, waiting for one; None once closed and empty."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._tasks or self._is_closed)
                if not self._tasks:
                    return None
                task = self._tasks.popleft()
                self._queued.discard(task.req_id)
                if task.req_id in self._skip:
                    self._skip.discard(task.req_id)
                    continue
                return task

    def close(self) -> None:
        """No more waiting: `get` returns what is queued, then None."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    def qsize(self) -> int:
        with self._cond:
            return len(self._tasks)

    @property
    def num_skips(self) -> int:
        """Aborts not yet consumed (each belongs to a task still queued)."""
        with self._cond:
            return len(self._skip)
