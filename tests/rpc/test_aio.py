"""AsyncRpcClient: concurrent calls on one connection, timeouts, late replies, events, errors."""

from __future__ import annotations

import asyncio

import pytest

from mooncake.errors import AuthError, RpcTimeout
from mooncake.rpc import AsyncRpcClient, RemoteError

from .conftest import SECRET, BeatMsg, EchoMsg, FailMsg, Served, SleepMsg


def test_concurrent_calls_each_get_their_own_reply(served: Served) -> None:
    async def main() -> list[EchoMsg]:
        async with AsyncRpcClient(served.address, SECRET) as c:
            return await asyncio.gather(*(c.call(EchoMsg("a", i), EchoMsg) for i in range(50)))

    assert asyncio.run(main()) == [EchoMsg("a", i) for i in range(50)]


def test_timeout_then_the_late_reply_is_dropped(served: Served) -> None:
    async def main() -> SleepMsg:
        async with AsyncRpcClient(served.address, SECRET) as c:
            with pytest.raises(RpcTimeout, match="test.sleep"):
                await c.call(SleepMsg(0.4, "first"), SleepMsg, timeout_s=0.1)
            return await c.call(SleepMsg(0.0, "second"), SleepMsg, timeout_s=5.0)

    assert asyncio.run(main()).label == "second"


def test_events_and_remote_errors(served: Served) -> None:
    async def main() -> None:
        async with AsyncRpcClient(served.address, SECRET) as c:
            await c.send_event(BeatMsg(7))
            with pytest.raises(RemoteError) as info:
                await c.call(FailMsg(crash=False), EchoMsg)
            assert info.value.remote_type == "StoreError"

    asyncio.run(main())
    assert served.events.get(timeout=5.0) == BeatMsg(7)


def test_wrong_secret_is_refused(served: Served) -> None:
    async def main() -> None:
        async with AsyncRpcClient(served.address, b"another-cluster-secret-xyz") as c:
            with pytest.raises(AuthError):
                await c.call(EchoMsg("x"), EchoMsg, timeout_s=10.0)  # refused long before

    asyncio.run(main())
    assert served.calls == []
