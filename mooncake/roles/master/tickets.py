"""The master's HTTP side talking to the Conductor without blocking its event loop.

The Conductor and the registry are shared with the master's RPC and housekeeping threads
under one `threading.Lock`, held there for whole decisions (a placement, a batch of store
events). The event loop never takes that lock itself: every call from asyncio code runs
on `Tickets`' one thread of its own, in the order made, so the loop only awaits a future
(`place`, `locked`) or queues the call and goes on (`decode_started`, `close`).

A request's Conductor ticket is opened by `place` and closed by `close` (finished or
dropped); `num_open` counts the open ones, for /health and the tests' audit. What takes
a lock of its own (the Store's, for a hot-spot replication order; the master's marking a
node down) runs on that thread too, outside the master's lock (`call`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from mooncake.api.backend import Rejected
from mooncake.conductor import Conductor
from mooncake.conductor.types import Decision, ReplicationOrder, ScheduleRequest
from mooncake.conductor.waiting import MIN_OFFER_GAP_S
from mooncake.config.roles import SchedulerConfig
from mooncake.errors import MooncakeError, SchedulingError
from mooncake.roles.master.metrics import PoolCounters
from mooncake.roles.master.registry import Registry

T = TypeVar("T")


class NoInstance(MooncakeError):
    """No prefill group or no decode node can take a request now."""


class MayWait(Rejected):
    """Refused for the queue ahead of it alone and waiting (`Decision.can_wait`): offer it
    again, with `waited`, for an idle prefill group, after `wait_s` seconds (when the
    next group is predicted idle)."""

    def __init__(self, message: str, wait_s: float):
        super().__init__(message, retry_after_s=2.0)
        self.wait_s = wait_s


class Tickets:
    """The Conductor's decisions and progress reports for the HTTP requests."""

    def __init__(self, conductor: Conductor, registry: Registry, lock: threading.Lock):
        self.conductor, self.registry, self.lock = conductor, registry, lock
        # hot-spot replication orders of the Conductor, for the Store to carry out
        self.on_replicate: Callable[[ReplicationOrder], None] = lambda _order: None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conductor")

    async def locked(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` under the lock, on the Conductor's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._run_locked, fn, *args)

    def _run_locked(self, fn: Callable[..., T], *args: object) -> T:
        with self.lock:
            return fn(*args)

    async def place(
        self, req_id: int, num_tokens: int, hashes: list[int], waited: bool = False
    ) -> Decision:
        """Open the request's ticket: the Conductor's placement (`waited`: offered again
        after a MayWait). Raises NoInstance (no node can take it now), MayWait (refused
        for the queue alone), Rejected (overload) or MooncakeError. Cancelled, it closes
        the ticket the placement may still open."""
        try:
            d, missing = await self.locked(self._schedule, req_id, num_tokens, hashes, waited)
        except asyncio.CancelledError:  # NOTE: runs after the placement, closing its ticket
            self.close(req_id, dropped=True)
            raise
        if d.replications:  # NOTE: the Store takes its own lock: not on the loop, not under ours
            self._thread.submit(self._replicate, d.replications)
        if not d.is_accepted:
            if d.reason == "no_instance":
                raise NoInstance(f"{missing or 'ready nodes are not scheduled yet'}; retry shortly")
            if d.can_wait:
                raise MayWait(f"every prefill group is busy ({d.reason})", d.wait_s)
            raise Rejected(
                f"the cluster is overloaded ({d.reason}); retry later", retry_after_s=2.0
            )
        return d

    def _replicate(self, orders: tuple[ReplicationOrder, ...]) -> None:
        for order in orders:
            self.on_replicate(order)

    def _schedule(
        self, req_id: int, n: int, hashes: list[int], waited: bool
    ) -> tuple[Decision, str]:
        try:
            req = ScheduleRequest(req_id, n, hashes)
            d = self.conductor.schedule(req, time.monotonic(), waited)
        except SchedulingError as e:
            raise MooncakeError(f"cannot place the request: {e}") from e
        missing = self.registry.missing() if d.reason == "no_instance" else ""
        return d, missing

    def end_wait(self, req_id: int) -> None:
        """A waiting request was refused after its wait, or its client went away."""
        self._thread.submit(self._run_locked, self.conductor.end_wait, req_id)

    def decode_started(self, req_id: int) -> None:
        self._thread.submit(self._run_locked, self._decode_started, req_id)

    def _decode_started(self, req_id: int) -> None:
        self.conductor.on_decode_started(req_id, time.monotonic())

    def close(self, req_id: int, dropped: bool) -> None:
        """Close the request's ticket: finished (its decode ended) or dropped."""
        self._thread.submit(self._run_locked, self._close, req_id, dropped)

    def _close(self, req_id: int, dropped: bool) -> None:
        if dropped:
            self.conductor.on_request_dropped(req_id, time.monotonic())
        else:
            self.conductor.on_decode_finished(req_id, time.monotonic())

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the Conductor's thread, without the lock (`fn` takes what it needs)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, fn, *args)

    async def num_open(self) -> int:
        """Open tickets, once every call made before this one has run."""
        return await self.locked(lambda: self.conductor.num_tickets)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


async def place_waiting(
    place: Callable[[bool], Awaitable[Decision]],
    sched: SchedulerConfig,
    node_wait_s: float,
    counters: PoolCounters,
    ends_at: float,
    end_wait: Callable[[], None],
) -> Decision:
    """`place(waited)` until it decides, within the request's deadline `ends_at`: waiting
    up to `node_wait_s` while no node can take it (NoInstance), trying again every
    `sched.node_poll_s`, and up to `sched.defer_s` in the Conductor's waiting room when
    it was refused for the queue alone (MayWait; then a Rejected naming the wait), tried
    again when the next prefill group is predicted idle (at most `node_poll_s` apart).
    `end_wait` tells the Conductor a wait ended unplaced."""
    give_up, wait_until, placed = min(time.monotonic() + node_wait_s, ends_at), 0.0, False
    try:
        while True:
            pause_s = sched.node_poll_s
            try:
                d = await place(wait_until > 0)
                placed = True
                if wait_until:
                    counters.waited += 1
                return d
            except NoInstance:
                if time.monotonic() >= give_up:
                    raise
            except MayWait as e:
                now = time.monotonic()
                if not wait_until:  # refused for the first time: it starts waiting
                    wait_until = min(now + sched.defer_s, ends_at)
                    counters.waiting += 1
                if now >= wait_until:
                    counters.waited_out += 1
                    why = f"{e}, none idle within {sched.defer_s:g} s; retry later"
                    raise Rejected(why, retry_after_s=e.retry_after_s) from None
                pause_s = min(pause_s, max(e.wait_s, MIN_OFFER_GAP_S), wait_until - now)
            await asyncio.sleep(pause_s)
    finally:
        if wait_until:
            counters.waiting -= 1
            if not placed:  # refused after waiting, or its client went away
                end_wait()
