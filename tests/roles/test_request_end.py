"""Every request ends, and every end closes its Conductor ticket: the master's
`ClusterBackend` with the real Conductor and registry, its nodes' calls recorded instead
of sent (no sockets). tests/roles/test_delivery_faults.py covers the same with real
processes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest

from mooncake.api.backend import GenerateRequest, Output
from mooncake.conductor.conductor import create_conductor
from mooncake.config.roles import SchedulerConfig
from mooncake.config.settings import Config
from mooncake.kv.hashing import PrefixHasher
from mooncake.model.info import load_model_info
from mooncake.model.params import SamplingParams
from mooncake.model.tokenizer import create_tokenizer
from mooncake.roles.master.cluster import ClusterBackend
from mooncake.roles.master.flight import Flight, request_deadline_s
from mooncake.roles.master.registry import Registry
from mooncake.roles.node.messages import NodeInfoMsg, NodeLoadMsg, TokenMsg, TokensMsg

pytestmark = pytest.mark.timeout(60)
PARAMS = SamplingParams(max_tokens=3, temperature=0)


def _backend(**scheduler: float) -> tuple[ClusterBackend, list[str]]:
    """A backend over one prefill node p0 and one decode node d0, both ready; returns it
    and the list of calls made to nodes ("task p0", "abort")."""
    cfg = Config(scheduler=SchedulerConfig(rejection="none", **scheduler))  # type: ignore[arg-type]
    info = load_model_info("dummy:tiny")
    reg = Registry(num_layers=4, group_size=1, ttl_s=60)
    for node, role in (("p0", "prefill"), ("d0", "decode")):
        reg.register(NodeInfoMsg(node, role, f"tcp://{node}:1"), time.monotonic())  # type: ignore[arg-type]
        reg.heartbeat(node, NodeLoadMsg(), "ready", time.monotonic())
    conductor = create_conductor(cfg, info)
    conductor.add_prefill_instance("p0")
    conductor.add_decode_instance("d0", 100_000)
    tok = create_tokenizer("dummy:tiny")
    backend = ClusterBackend(conductor, reg, tok, "m", 1024, b"s" * 32, 32, threading.Lock())
    backend.configure(cfg)
    backend.hasher = PrefixHasher(32, b"s" * 32, bytes(16))
    calls: list[str] = []

    async def send_task(flight: Flight) -> None:
        calls.append(f"task {flight.decision.prefill}")

    async def abort(flight: Flight) -> None:
        calls.append("abort")

    backend.calls.send_task = send_task  # type: ignore[method-assign]
    backend.calls.abort = abort  # type: ignore[method-assign]
    return backend, calls


def _request(prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(req_id="r", prompt_ids=prompt or list(range(1, 40)), params=PARAMS)


async def _in_flight(backend: ClusterBackend, it: AsyncIterator[Output]) -> asyncio.Task[Output]:
    task = asyncio.ensure_future(it.__anext__())
    while not backend.flights:
        await asyncio.sleep(0.001)
    return task


def test_the_deadline_formula() -> None:
    s = SchedulerConfig(ttft_slo_s=2.0, tbt_slo_s=0.1, deadline_factor=3.0, deadline_slack_s=5.0)
    assert request_deadline_s(s, 10) == pytest.approx(5.0 + 3.0 * (2.0 + 10 * 0.1))


def test_a_request_whose_tokens_never_come_ends_at_its_deadline_and_closes_its_ticket() -> None:
    """Nothing ever arrives from the decode node (a lost final event, a silent node): the
    request ends with an error naming its deadline and where it was, its nodes are told
    to drop it, and its Conductor ticket closes. (Before: it waited forever.)"""
    backend, calls = _backend(deadline_slack_s=0.2, deadline_factor=0.01)

    async def main() -> tuple[list[Output], int]:
        outs = [o async for o in backend.generate(_request())]
        await asyncio.gather(*backend._tasks)
        return outs, await backend.tickets.num_open()

    outs, num_open = asyncio.run(main())
    (out,) = outs
    assert out.finish_reason == "abort"
    assert out.error.startswith("no end within its deadline of 0.5 s (queued at prefill node p0")
    assert calls == ["task p0", "abort"]
    assert num_open == 0 and not backend.flights


def test_a_dispatch_that_does_not_return_ends_at_the_deadline_too() -> None:
    backend, calls = _backend(deadline_slack_s=0.2, deadline_factor=0.01)

    async def hung_leader(flight: Flight) -> None:
        await asyncio.Event().wait()  # a leader that never answers (no call timeout here)

    backend.calls.send_task = hung_leader  # type: ignore[method-assign]

    async def main() -> tuple[list[Output], int]:
        outs = [o async for o in backend.generate(_request())]
        await asyncio.gather(*backend._tasks)
        return outs, await backend.tickets.num_open()

    outs, num_open = asyncio.run(main())
    assert [o.finish_reason for o in outs] == ["abort"] and "deadline" in outs[0].error
    assert calls == ["abort"] and num_open == 0 and not backend.flights


def test_token_events_reach_the_client_in_order_each_once_and_are_acknowledged() -> None:
    backend, _ = _backend()

    async def main() -> tuple[list[int], list[list[tuple[int, bool]]]]:
        it = backend.generate(_request())
        first = await _in_flight(backend, it)
        (rid,) = backend.flights
        ev = [TokenMsg(rid, 100 + i, "x", seq=i) for i in range(3)]
        ev[2] = msgspec.structs.replace(ev[2], finish_reason="length")
        acks = []
        batches = [("d0", [ev[1]]), ("d0", [ev[0], ev[1]]), ("d0", [ev[0]])]
        batches += [("p0", [ev[2]]), ("d0", [ev[2]])]
        for node, batch in batches:
            reply = backend.receive_tokens(TokensMsg(node, batch))
            acks.append([(a.next_seq, a.is_known) for a in reply.acks])
        outs = [await first] + [o async for o in it]
        return [o.token_id for o in outs], acks

    ids, acks = asyncio.run(main())
    assert ids == [100, 101, 102]  # seq 1 waited for seq 0; the duplicates were dropped
    # cumulative: nothing below 0 yet; then 0 and 1; a duplicate changes nothing; a node
    # the request is not placed on is told the master does not track it there
    assert acks == [[(0, True)], [(2, True)], [(2, True)], [(0, False)], [(3, True)]]


def test_a_client_gone_mid_request_closes_its_ticket_under_anyio_cancellation() -> None:
    """The HTTP layer cancels a gone client's request in an anyio cancel scope, which
    cancels every later await of the request too: its end still closes the ticket and
    tells its nodes. (Before: the end awaited the nodes' aborts first, was cancelled there,
    and the ticket stayed open.)"""
    backend, calls = _backend()

    async def abort(flight: Flight) -> None:
        await asyncio.sleep(0)  # an RPC: an await
        calls.append("abort")

    backend.calls.abort = abort  # type: ignore[method-assign]

    async def main() -> int:
        it = backend.generate(_request())

        async def consume() -> None:
            async for _ in it:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            while not backend.flights:
                await asyncio.sleep(0.001)
            tg.cancel_scope.cancel()
        await asyncio.gather(*backend._tasks)
        return await backend.tickets.num_open()

    assert asyncio.run(main()) == 0
    assert not backend.flights and calls == ["task p0", "abort"]


def test_a_request_that_ends_while_it_is_placed_again_leaves_no_ticket() -> None:
    """Its prefill node failed and a re-placement is under way (its abort of the old
    placement is slow) when the client goes away: the new placement, made after the end,
    closes its ticket at once. (Before: the re-placement booked a ticket nobody closed.)"""
    backend, calls = _backend()
    gate = asyncio.Event()

    async def main() -> int:
        aborts = 0

        async def slow_first_abort(flight: Flight) -> None:
            nonlocal aborts
            aborts += 1
            if aborts == 1:
                await gate.wait()

        backend.calls.abort = slow_first_abort  # type: ignore[method-assign]
        it = backend.generate(_request())
        first = await _in_flight(backend, it)
        (flight,) = backend.flights.values()
        backend.on_prefill_failed(flight.req_id, "p0", "prefill failed on p0: boom")
        while not flight.is_replacing:
            await asyncio.sleep(0.001)
        first.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await first
        gate.set()
        await asyncio.gather(*backend._tasks)
        return await backend.tickets.num_open()

    assert asyncio.run(main()) == 0
    assert not backend.flights


def test_a_placement_waits_for_the_masters_lock_off_the_event_loop() -> None:
    """The master's lock is held by another thread (its housekeeping applying a batch of
    store events) while a request is placed: the event loop goes on serving meanwhile.
    Shown by order: a coroutine scheduled after the placement began runs before the
    lock's holder lets go (it waits up to 5 s for that). (Before: `with self.lock` on the
    loop stalled every request and /health until the lock was free.)"""
    backend, _ = _backend()
    order: list[str] = []
    held, loop_ran = threading.Event(), threading.Event()

    def hold() -> None:
        with backend.lock:
            held.set()
            loop_ran.wait(5.0)
            order.append("lock released")

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()

    async def main() -> list[int]:
        it = backend.generate(_request())
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.01)  # the placement starts and waits for the lock
        order.append("loop ran")
        loop_ran.set()
        while not backend.flights:
            await asyncio.sleep(0.001)
        (rid,) = backend.flights
        end = TokenMsg(rid, 5, "x", finish_reason="length")
        backend.receive_tokens(TokensMsg("d0", [end]))
        return [(await first).token_id]

    assert asyncio.run(main()) == [5]
    holder.join()
    assert order == ["loop ran", "lock released"]
