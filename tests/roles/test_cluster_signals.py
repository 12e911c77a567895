"""What the master queues for a request itself travels as typed `TokenMsg.kind`s, not as
sentinels: "dispatch_again" (placed again: send the task anew) and "rejected" (the
Conductor refused it at prefill start: a 429 before any output). Checked on a
`ClusterBackend` whose placement and dispatch are stubbed (no nodes, no sockets)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import cast

import pytest

from mooncake.api.backend import GenerateRequest, Output, Rejected
from mooncake.conductor.conductor import Conductor
from mooncake.conductor.types import Decision, PrefillAdmission
from mooncake.kv.hashing import PrefixHasher
from mooncake.model.params import SamplingParams
from mooncake.model.tokenizer import ByteTokenizer
from mooncake.roles.master.cluster import ClusterBackend
from mooncake.roles.master.flight import Flight
from mooncake.roles.master.registry import Registry
from mooncake.roles.node.messages import TokenMsg, TokensMsg

pytestmark = pytest.mark.timeout(30)
PARAMS = SamplingParams(max_tokens=2, temperature=0)


class _Conductor:
    def __getattr__(self, name: str):  # on_request_dropped, on_decode_started, ...
        return lambda *args: None


def _backend() -> tuple[ClusterBackend, list[str]]:
    registry = Registry(num_layers=4, group_size=1, ttl_s=5.0)  # no node: no KV limit known
    conductor = cast(Conductor, _Conductor())
    backend = ClusterBackend(
        conductor,
        registry,
        ByteTokenizer(),
        "m",
        1024,
        b"s" * 32,
        16,
        threading.Lock(),
    )
    backend.hasher = PrefixHasher(16, b"s" * 32, bytes(16))
    dispatched: list[str] = []

    async def place(rid: int, n: int, hashes: list[int]) -> Decision:
        return Decision(req_id=rid, is_accepted=True, prefill=f"p{len(dispatched)}", decode="d")

    async def place_waiting(rid: int, n: int, hashes: list[int], ends_at: float) -> Decision:
        return await place(rid, n, hashes)

    async def dispatch(flight) -> None:
        dispatched.append(flight.decision.prefill)

    backend._place = place  # type: ignore[method-assign]
    backend._place_waiting = place_waiting  # type: ignore[method-assign]
    backend._dispatch_retrying = dispatch  # type: ignore[method-assign]
    return backend, dispatched


async def _first(backend: ClusterBackend, it: AsyncIterator[Output]) -> asyncio.Future[Output]:
    task = asyncio.ensure_future(it.__anext__())
    while not backend.flights:
        await asyncio.sleep(0.001)
    return task


def test_a_rejection_at_prefill_start_is_a_typed_429_before_any_output() -> None:
    backend, _ = _backend()

    async def main() -> None:
        it = backend.generate(GenerateRequest(req_id="r", prompt_ids=[1, 2, 3], params=PARAMS))
        task = await _first(backend, it)
        (rid,) = backend.flights
        backend.on_prefill_admission(
            rid, PrefillAdmission(req_id=rid, is_accepted=False, reason="ttft_slo")
        )
        with pytest.raises(Rejected, match=r"^the cluster is overloaded \(ttft_slo\)$"):
            await task

    asyncio.run(main())
    assert not backend.flights


def test_a_request_placed_again_is_dispatched_again_then_streams() -> None:
    backend, dispatched = _backend()

    async def main() -> list[int]:
        it = backend.generate(GenerateRequest(req_id="r", prompt_ids=[1, 2, 3], params=PARAMS))
        task = await _first(backend, it)
        (flight,) = backend.flights.values()
        backend._replace(flight, "p0")  # its prefill node died
        while len(dispatched) < 2:
            await asyncio.sleep(0.001)
        backend.receive_tokens(TokensMsg("d", [TokenMsg(flight.req_id, 7, "x")]))
        first = await task
        last = TokenMsg(flight.req_id, 8, "y", finish_reason="length", seq=1)
        backend.receive_tokens(TokensMsg("d", [last]))
        rest = [out async for out in it]
        return [o.token_id for o in [first, *rest]]

    assert asyncio.run(main()) == [7, 8]
    assert dispatched == ["p0", "p1"]
    assert TokenMsg(1, 7, "x").kind == "output"  # what nodes send


def test_the_masters_own_messages_say_what_they_are() -> None:
    backend, _ = _backend()

    async def main() -> tuple[TokenMsg, TokenMsg, int]:
        backend.loop = asyncio.get_running_loop()
        gen = GenerateRequest(req_id="r", prompt_ids=[1, 2, 3], params=PARAMS)
        decision = Decision(req_id=5, is_accepted=True, prefill="p0", decode="d")
        flight = Flight(5, gen, [], asyncio.Queue(), decision)
        backend.flights[5] = flight
        admission = PrefillAdmission(req_id=5, is_accepted=False, reason="decode_load")
        backend.on_prefill_admission(5, admission)
        rejected = await flight.queue.get()
        backend._replace(flight, "p0")
        again = await flight.queue.get()
        return rejected, again, flight.req_id

    rejected, again, new_id = asyncio.run(main())
    assert (rejected.kind, rejected.req_id, rejected.finish_reason) == ("rejected", 5, "abort")
    assert rejected.error == "the cluster is overloaded (decode_load)"  # no prefix to parse
    assert (again.kind, again.req_id) == ("dispatch_again", new_id) and new_id != 5
