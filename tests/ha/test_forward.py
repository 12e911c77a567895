"""A standby's HTTP API (ha/forward.py): forwarded to the leader, and a clear, retryable
error when there is none or it does not answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mooncake.api.server import CLOSING, ApiServer, bind_socket
from mooncake.ha.forward import Forwarder, LeaderSwitch


async def _echo(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse(
        {
            "path": request.url.path,
            "query": request.url.query,
            "body": body,
            "auth": request.headers.get("authorization", ""),
        },
        status_code=201,
    )


def _call(app: object, method: str, path: str, **kw: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://standby") as c:
            return await c.request(method, path, **kw)  # type: ignore[arg-type]

    return asyncio.run(go())


def test_requests_reach_the_leader_with_their_path_query_body_and_headers():
    leader = ApiServer(Starlette(routes=[Route("/v1/x", _echo, methods=["POST"])]))
    leader.start_in_thread()
    try:
        fwd = Forwarder(lambda: leader.url, connect_timeout_s=2.0, check_s=0.1)
        r = _call(
            fwd, "POST", "/v1/x?a=1", json={"k": [1, 2]}, headers={"Authorization": "Bearer key"}
        )
        assert r.status_code == 201
        assert r.json() == {
            "path": "/v1/x",
            "query": "a=1",
            "body": {"k": [1, 2]},
            "auth": "Bearer key",
        }
    finally:
        leader.stop()


def test_no_leader_is_503_with_retry_after_and_a_dead_one_is_502():
    r = _call(Forwarder(lambda: None, 2.0, 0.1), "GET", "/v1/models")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "election" in r.json()["error"]["message"]
    sock = bind_socket("127.0.0.1", 0)  # NOTE: a port bound but never listened on
    port = sock.getsockname()[1]
    sock.close()
    r = _call(Forwarder(lambda: f"http://127.0.0.1:{port}", 2.0, 0.1), "GET", "/v1/models")
    assert r.status_code == 502 and "retry" in r.json()["error"]["message"]


def test_the_switch_serves_its_own_app_once_it_leads():
    own = Starlette(routes=[Route("/v1/x", _echo, methods=["POST"])])
    switch = LeaderSwitch(Forwarder(lambda: None, 2.0, 0.1), own)
    assert _call(switch, "POST", "/v1/x", json={}).status_code == 503
    switch.lead()
    assert _call(switch, "POST", "/v1/x", json={}).status_code == 201


async def _slow_events(request: Request) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for i in range(4):
            await asyncio.sleep(0.3)  # NOTE: several checks of the leader between chunks
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


def _stream_through(fwd: Forwarder) -> list[str]:
    async def go() -> list[str]:
        transport = httpx.ASGITransport(app=fwd)
        async with httpx.AsyncClient(transport=transport, base_url="http://standby") as c:
            r = await c.get("/events")
            return [line for line in r.text.split("\n") if line]

    return asyncio.run(go())


def test_a_slow_stream_comes_through_whole_and_ends_with_an_error_if_the_leader_changes():
    leader = ApiServer(Starlette(routes=[Route("/events", _slow_events)]))
    leader.start_in_thread()
    try:
        assert _stream_through(Forwarder(lambda: leader.url, 2.0, 0.05)) == [
            f"data: {i}" for i in range(4)
        ]
        urls = iter([leader.url] * 10)  # NOTE: then another master leads
        lines = _stream_through(Forwarder(lambda: next(urls, "http://other"), 2.0, 0.05))
        assert lines[0] == "data: 0" and len(lines) < 5
        assert "leading master changed" in lines[-1] and "retry" in lines[-1]
    finally:
        leader.stop()


def test_a_stream_relayed_when_the_standby_stops_ends_with_an_error_event():
    """The standby's drain over (its server sets CLOSING), a relayed stream ends at once
    with an error event instead of being cut when the server cancels it."""
    leader = ApiServer(Starlette(routes=[Route("/events", _slow_events)]))
    leader.start_in_thread()
    fwd = Forwarder(lambda: leader.url, 2.0, 0.05)

    async def go() -> list[str]:
        closing = asyncio.Event()

        async def app(scope, receive, send):  # type: ignore[no-untyped-def]
            scope = {**scope, "extensions": {**scope.get("extensions", {}), CLOSING: closing}}
            await fwd(scope, receive, send)

        asyncio.get_running_loop().call_later(0.45, closing.set)  # after the first event
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://standby") as c:
            r = await c.get("/events")
            return [line for line in r.text.split("\n") if line]

    try:
        lines = asyncio.run(go())
        assert lines[0] == "data: 0" and len(lines) == 2, lines
        assert "shutting down" in lines[-1] and lines[-1].startswith("data: {")
    finally:
        leader.stop()
