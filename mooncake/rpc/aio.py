"""AsyncRpcClient: the asyncio twin of RpcClient, for the HTTP API and other coroutines.

One DEALER socket per client multiplexes any number of concurrent calls: a reader task
hands each reply to the future waiting for its request id and drops late replies.
Use a client from the one event loop that first used it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import mooncake.rpc.wire as wire
from mooncake.errors import ProtocolError, RpcError
from mooncake.rpc.auth import HandshakeWatch, check_secret
from mooncake.rpc.client import auth_refused, dealer_socket, timeout_error
from mooncake.rpc.wire import M, Msg

log = logging.getLogger(__name__)

_RETRY_S = 0.005  # seconds between send attempts while not connected (not the hot path)
_Reply = tuple[int, bytes, bytes, int]  # kind, tag, frame, body offset


class AsyncRpcClient:
    """Calls one server from asyncio code; safe for concurrent coroutines of one loop."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        *,
        timeout_s: float = 5.0,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    ):
        """`secret=None` disables authentication and encryption (benchmarks, tests only)."""
        if secret is not None:
            check_secret(secret)
        self.address = address
        self.secret = secret
        self.timeout_s = timeout_s  # default for call() and send_event()
        self.max_frame_bytes = max_frame_bytes
        self._sock: zmq.asyncio.Socket | None = None
        self._watch: HandshakeWatch | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[_Reply]] = {}  # request id -> its reply
        self._encoder = msgspec.msgpack.Encoder()
        self._req_id = 0  # last request id sent

    async def call(self, msg: Msg, reply_type: type[M], *, timeout_s: float | None = None) -> M:
        """Send `msg` and return its reply of `reply_type`; raises like RpcClient.call."""
        sock = self._socket()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        info = wire.msg_type(reply_type)
        self._req_id += 1
        req_id = self._req_id
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        sent = False
        try:
            async with asyncio.timeout(timeout_s):
                frame = wire.encode_frame(self._encoder, wire.KIND_REQUEST, req_id, msg)
                await self._send(sock, frame, msg)
                sent = True
                kind, tag, data, offset = await fut
        except TimeoutError:
            raise self._timeout(msg, timeout_s, sent) from None
        finally:
            self._pending.pop(req_id, None)
        return wire.unpack_reply(info, data, kind, tag, offset, msg, self.address)

    async def send_event(self, msg: Msg, *, timeout_s: float | None = None) -> None:
        """Queue the one-way event `msg`; raises RpcTimeout if there is no connection in time,
        AuthError if the server refuses our key."""
        sock = self._socket()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self._send(
                    sock, wire.encode_frame(self._encoder, wire.KIND_EVENT, 0, msg), msg
                )
        except TimeoutError:
            raise self._timeout(msg, timeout_s, False) from None

    async def close(self) -> None:
        """Cancel pending calls and close the connection; idempotent."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> AsyncRpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            ctx = zmq.asyncio.Context.instance()
            sock: Any = dealer_socket(ctx, self.address, self.secret, self.max_frame_bytes)
            self._sock = sock
            self._watch = HandshakeWatch(sock) if self.secret is not None else None
            self._reader = asyncio.create_task(self._read(sock), name=f"rpc-reader {self.address}")
        return self._sock

    async def _send(self, sock: zmq.asyncio.Socket, frame: bytes, msg: Msg) -> None:
        """Send `frame`; while not connected, retry and raise AuthError once we are refused."""
        while True:
            try:
                await sock.send(frame, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if self._watch is not None and self._watch.poll():
                raise auth_refused(self.address, wire.msg_type(type(msg)).tag)
            await asyncio.sleep(_RETRY_S)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            data = await sock.recv()
            try:
                kind, req_id, tag, offset = wire.parse_head(data, self.max_frame_bytes)
            except ProtocolError as e:
                log.warning("bad frame from %s: %s", self.address, e)
                continue
            fut = self._pending.get(req_id)
            if fut is None or fut.done():
                log.debug("dropped a late reply (id %d) from %s", req_id, self.address)
                continue
            fut.set_result((kind, tag, data, offset))

    def _timeout(self, msg: Msg, timeout_s: float, sent: bool) -> RpcError:
        tag = wire.msg_type(type(msg)).tag
        return timeout_error(self._watch, self.address, tag, timeout_s, sent)
