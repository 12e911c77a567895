"""A standby master's HTTP API: every request forwarded to the leader, so that a client
keeps one URL per master.

`LeaderSwitch` is the ASGI app a master serves from its start: it forwards (`Forwarder`)
while the master stands by, and serves the master's own app once it leads. Forwarding
streams the leader's answer through as it comes (SSE included). With no leader known (an
election under way) the answer is 503 with `Retry-After`; a leader that does not answer is
502; a leader lost in the middle of an answer ends it: a stream gets a last error event,
any other body is cut short, so no client waits on a dead leader. So does the standby's own
stop once its drain is over (`server.CLOSING`), as the master's own answers do.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from mooncake.api.server import CLOSING

log = logging.getLogger(__name__)
_HOP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"upgrade",
    b"host",
    b"proxy-connection",
    b"content-length",
}


def error_bytes(message: str, kind: str) -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": kind, "code": None}}).encode()


async def send_error(send: Send, status: int, message: str, kind: str) -> None:
    body = error_bytes(message, kind)
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Forwarder:
    """Forwards to the API URL `leader_url()` names (None: no leader known)."""

    def __init__(
        self, leader_url: Callable[[], str | None], connect_timeout_s: float, check_s: float
    ):
        self.leader_url = leader_url
        self.check_s = check_s  # s between checks that the leader did not change mid-answer
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=None, pool=None)
        self._client: httpx.AsyncClient | None = None
        self._timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        url = self.leader_url()
        if url is None:
            await send_error(
                send,
                503,
                "no master leads the cluster right now (an election "
                "is under way); retry in a second",
                "unavailable",
            )
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        query = scope.get("query_string", b"").decode()
        target = url + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        req = self._client.build_request(
            scope["method"], target, headers=headers, content=bytes(body)
        )
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            await send_error(
                send,
                502,
                f"the leading master at {url} did not answer ({e}); "
                "retry: another master takes over",
                "unavailable",
            )
            return
        closing: asyncio.Event | None = scope.get("extensions", {}).get(CLOSING)
        try:
            await self._relay(resp, url, send, closing)
        finally:
            await resp.aclose()

    async def _relay(
        self, resp: httpx.Response, url: str, send: Send, closing: asyncio.Event | None
    ) -> None:
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        is_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        chunks = resp.aiter_raw()
        # NOTE: one read in flight across the checks (cancelling a read breaks the stream)
        pending = asyncio.ensure_future(anext(chunks))
        closed = asyncio.ensure_future(closing.wait()) if closing is not None else None
        waits = {pending} if closed is None else {pending, closed}
        try:
            while True:
                done, _ = await asyncio.wait(waits, timeout=self.check_s)
                if closed is not None and closed in done:
                    pending.cancel()
                    why = "this master is shutting down: the answer was ended before it finished"
                elif not done:
                    if self.leader_url() == url:
                        continue  # NOTE: a slow answer from a leader still in office
                    pending.cancel()
                    why = "the leading master changed while it answered; retry the request"
                else:
                    try:
                        chunk = pending.result()
                    except StopAsyncIteration:
                        break
                    except httpx.HTTPError as e:
                        why = (
                            f"the leading master at {url} went away while it answered ({e}); retry"
                        )
                    else:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        pending = asyncio.ensure_future(anext(chunks))
                        waits = {pending} if closed is None else {pending, closed}
                        continue
                log.warning("forwarding: %s", why)
                if not is_stream:  # NOTE: the connection is cut: the client sees a broken body
                    raise ConnectionAbortedError(why)
                tail = b"data: " + error_bytes(why, "unavailable") + b"\n\n"
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            pending.cancel()  # NOTE: a no-op once done; else the client left mid-answer
            if closed is not None:
                closed.cancel()


class LeaderSwitch:
    """The app a master serves: `standby` until `lead()` switches it to `leader`."""

    def __init__(self, standby: Any, leader: Any):
        self._standby, self._leader = standby, leader
        self.app = standby

    def lead(self) -> None:
        self.app = self._leader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
