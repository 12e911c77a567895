"""The waiting room: requests refused only for the prefill queue ahead of them, waiting
for a prefill group with nothing queued (`scheduler.defer_s`), oldest first.

Entering. A request joins only if a group is predicted idle for it within `defer_s`:
each group frees its first stage once its queued first-stage seconds have run, the
requests already waiting take the groups as they free, oldest first, each for its own
first-stage seconds, and the newcomer starts when the next group frees after them. One
that would not start in time is refused at once: under overload a client learns in
milliseconds what it would otherwise learn after `defer_s` (and a benchmark's run does
not end with a tail of late refusals).

Its turn. With m groups idle, the m oldest waiting requests may be placed (on one of
those groups); the others keep waiting. `next_idle_s` tells a waiting request when the
next group is predicted to go idle, so the caller offers it again then rather than on
a coarse poll, and a group does not sit idle between polls.

Leaving. Placed or refused for another reason (the Conductor removes it), refused after
its wait (the caller calls `leave`, as the master and the simulator do), or `grace_s`
past its wait (a guard against a caller that never says). Pure bookkeeping; `now` is
passed in.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from mooncake.conductor.types import Decision

# the least pause between two offers of a waiting request (the master's, the simulator's):
# a group predicted idle "now" must not make a busy loop
MIN_OFFER_GAP_S = 0.005


@dataclass(slots=True)
class _Waiter:
    stage_s: float  # its first-stage seconds on the group it was priced on
    until: float  # its wait ends (then `grace_s` more before it is dropped unasked)


class WaitingRoom:
    """Requests waiting for an idle prefill group, in arrival order."""

    def __init__(self, defer_s: float, grace_s: float = 1.0):
        self.defer_s, self.grace_s = defer_s, grace_s
        self._waiters: dict[int, _Waiter] = {}  # insertion order = arrival order

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._waiters

    def start_s(self, free_s: list[float]) -> float:
        """Seconds until a group is idle for a request joining now, behind those waiting:
        `free_s` is each group's queued first-stage seconds (module docstring)."""
        if not free_s:
            return math.inf
        heap = sorted(free_s)  # a sorted list is a heap
        for w in self._waiters.values():
            heapq.heapreplace(heap, heap[0] + w.stage_s)
        return heap[0]

    def enter(self, req_id: int, stage_s: float, free_s: list[float], now: float) -> bool:
        """Join, if a group is predicted idle for it within `defer_s`; False = refused."""
        self.expire(now)
        if self.start_s(free_s) > self.defer_s:
            return False
        self._waiters[req_id] = _Waiter(stage_s, now + self.defer_s)
        return True

    def rank(self, req_id: int, now: float) -> int | None:
        """How many wait ahead of it; None when it is not waiting (left, or dropped)."""
        self.expire(now)
        return next((i for i, rid in enumerate(self._waiters) if rid == req_id), None)

    def leave(self, req_id: int) -> None:
        self._waiters.pop(req_id, None)

    def expire(self, now: float) -> None:
        """Drop the waiters `grace_s` past their wait (all wait the same `defer_s`, so the
        oldest ends first)."""
        while self._waiters:
            rid, w = next(iter(self._waiters.items()))
            if now <= w.until + self.grace_s:
                return
            del self._waiters[rid]

    def turn(self, req_id: int, free_s: list[float], now: float) -> Decision | None:
        """A waiting request offered again: None when it may be placed now (fewer wait
        ahead of it than groups are idle), else its refusal: still waiting (`wait_on`),
        or not waiting any more (dropped past its wait)."""
        rank = self.rank(req_id, now)
        if rank is None:
            return Decision(req_id=req_id, is_accepted=False, reason="ttft_slo")
        if rank < sum(s <= 0.0 for s in free_s):
            return None
        return self.wait_on(req_id, free_s)

    @staticmethod
    def wait_on(req_id: int, free_s: list[float]) -> Decision:
        """Refused again, still waiting: offer it again when the next group is idle."""
        return Decision(
            req_id=req_id,
            is_accepted=False,
            reason="ttft_slo",
            can_wait=True,
            wait_s=next_idle_s(free_s),
        )


def next_idle_s(free_s: list[float]) -> float:
    """Seconds until the next busy group is predicted idle (inf: none is busy)."""
    return min((s for s in free_s if s > 0.0), default=math.inf)
