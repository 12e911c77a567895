"""A request the Conductor refused for the prefill queue ahead of it alone waits at the
master, offered again when a group is predicted idle (at most `node_poll_s` apart), for a
group with nothing queued, up to `scheduler.defer_s`; then it is a 429 naming the wait,
and it leaves the Conductor's waiting room. One not predicted to start in time is refused
at once. Checked on a `ClusterBackend` with a real Conductor (round-number costs: 1 ms of
prefill per token), no nodes."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest

from mooncake.api.backend import Rejected
from mooncake.conductor.types import Decision
from mooncake.config.settings import Config
from mooncake.model.tokenizer import ByteTokenizer
from mooncake.roles.master.cluster import ClusterBackend
from mooncake.roles.master.registry import Registry
from tests.conductor.toy import toy_conductor

pytestmark = pytest.mark.timeout(30)


def _backend(defer_s: float) -> ClusterBackend:
    conductor = toy_conductor(1, 1, ttft_slo_s=1.0, defer_s=defer_s)
    lock = threading.Lock()
    registry = cast(Registry, SimpleNamespace(nodes={}, missing=lambda: ""))
    backend = ClusterBackend(conductor, registry, ByteTokenizer(), "m", 4096, b"s" * 32, 100, lock)
    config = Config()
    sched = msgspec.structs.replace(config.scheduler, defer_s=defer_s, node_poll_s=0.02)
    backend.configure(msgspec.structs.replace(config, scheduler=sched))
    return backend


async def _hold_the_group_and_wait(backend: ClusterBackend) -> asyncio.Future[Decision]:
    """Place a 0.8 s prompt on the only group, then a 0.5 s one that must wait behind it;
    returns the waiting one's placement, still running."""
    first = await backend._place_waiting(1, 800, [1], time.monotonic() + 60)
    assert first.is_accepted  # 0.8 s queued on the only group now
    return asyncio.ensure_future(backend._place_waiting(2, 500, [2], time.monotonic() + 60))


def test_a_request_refused_for_the_queue_runs_once_the_group_is_idle() -> None:
    backend = _backend(defer_s=5.0)
    conductor = backend.conductor

    async def main() -> None:
        waiting = await _hold_the_group_and_wait(backend)
        await asyncio.sleep(0.2)
        assert not waiting.done() and conductor.num_inflight == 1  # nothing booked yet
        assert backend.counters.waiting == 1
        with backend.lock:
            conductor.on_prefill_started(1, time.monotonic())
            conductor.on_prefill_finished(1, time.monotonic())  # the group is idle
        d = await asyncio.wait_for(waiting, 5)
        assert d.is_accepted and d.prefill == "p0" and conductor.num_inflight == 2
        c = backend.counters
        assert (c.waiting, c.waited, c.waited_out) == (0, 1, 0)

    asyncio.run(main())


def test_a_request_no_group_takes_within_defer_s_is_a_429_naming_the_wait() -> None:
    backend = _backend(defer_s=1.0)

    async def main() -> None:
        start = time.monotonic()
        # predicted to start in 0.8 s, but request 1 never starts: it waits its 1 s out
        waiting = await _hold_the_group_and_wait(backend)
        await asyncio.sleep(0.1)
        # behind it, another 0.5 s prompt would start at 1.3 s: refused at once
        with pytest.raises(Rejected, match="overloaded"):
            await backend._place_waiting(3, 500, [3], time.monotonic() + 60)
        with pytest.raises(Rejected, match="none idle within 1 s") as e:
            await waiting
        assert time.monotonic() - start >= 1.0 and e.value.retry_after_s > 0
        assert backend.conductor.num_inflight == 1
        assert await backend.tickets.num_open() == 1  # (after the queued end_wait)
        assert len(backend.conductor.waiting) == 0
        c = backend.counters
        assert (c.waiting, c.waited, c.waited_out) == (0, 0, 1)
        # a prompt over the SLO even alone is refused at once: it never waited
        with pytest.raises(Rejected, match="overloaded"):
            await backend._place_waiting(4, 1_200, [4], time.monotonic() + 60)
        assert (c.waiting, c.waited, c.waited_out) == (0, 0, 1)

    asyncio.run(main())


def test_a_waiting_request_whose_client_goes_away_leaves_the_room() -> None:
    backend = _backend(defer_s=5.0)

    async def main() -> None:
        waiting = await _hold_the_group_and_wait(backend)
        await asyncio.sleep(0.1)
        assert 2 in backend.conductor.waiting
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await backend.tickets.num_open()  # after the queued end_wait
        assert len(backend.conductor.waiting) == 0 and backend.counters.waiting == 0

    asyncio.run(main())
