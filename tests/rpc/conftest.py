"""Shared RPC fixtures: test messages, a recording server, raw zmq sockets for bad peers."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq

from mooncake.errors import StoreError
from mooncake.rpc import Msg, Peer, RpcClient, RpcServer, wire
from mooncake.rpc.auth import derive_keypair

SECRET = b"test-cluster-secret-0123456789"
MAX_FRAME_BYTES = 64 * 1024  # small, so that tests can exceed it cheaply


class EchoMsg(Msg, frozen=True, tag="test.echo"):
    text: str
    num: int = 0


class SleepMsg(Msg, frozen=True, tag="test.sleep"):
    seconds: float  # how long the handler sleeps before answering
    label: str  # echoed back, to tell replies apart


class FailMsg(Msg, frozen=True, tag="test.fail"):
    crash: bool  # True: a plain exception (a bug); False: a StoreError (an expected failure)


class BadReplyMsg(Msg, frozen=True, tag="test.bad_reply"):
    pass


class BeatMsg(Msg, frozen=True, tag="test.beat"):
    node_id: int


class UnservedMsg(Msg, frozen=True, tag="test.unserved"):
    pass


@dataclass
class Served:
    """A running server and what its handlers saw."""

    server: RpcServer
    calls: list[Msg] = field(default_factory=list)  # every request a handler received
    peers: list[Peer] = field(default_factory=list)
    events: queue.Queue[BeatMsg] = field(default_factory=queue.Queue)

    @property
    def address(self) -> str:
        return self.server.address


def start_server(bind: str = "tcp://127.0.0.1:0", secret: bytes | None = SECRET) -> Served:
    server = RpcServer(bind, secret, max_frame_bytes=MAX_FRAME_BYTES, name="test")
    served = Served(server)
    lock = threading.Lock()

    def record(msg: Msg, peer: Peer) -> None:
        with lock:
            served.calls.append(msg)
            served.peers.append(peer)

    def echo(msg: EchoMsg, peer: Peer) -> EchoMsg:
        record(msg, peer)
        return msg

    def sleep(msg: SleepMsg, peer: Peer) -> SleepMsg:
        record(msg, peer)
        time.sleep(msg.seconds)
        return msg

    def fail(msg: FailMsg, peer: Peer) -> EchoMsg:
        record(msg, peer)
        if msg.crash:
            raise KeyError("boom")
        raise StoreError("object 'k1' not found: it was never put or has been evicted")

    def bad_reply(msg: BadReplyMsg, peer: Peer) -> Any:
        record(msg, peer)
        return {"not": "a Msg"}

    server.register(EchoMsg, echo)
    server.register(SleepMsg, sleep)
    server.register(FailMsg, fail)
    server.register(BadReplyMsg, bad_reply)
    server.on_event(BeatMsg, lambda msg, peer: served.events.put(msg))
    server.start()
    return served


@pytest.fixture
def served() -> Iterator[Served]:
    s = start_server()
    yield s
    s.server.stop()


@pytest.fixture
def client(served: Served) -> Iterator[RpcClient]:
    c = RpcClient(served.address, SECRET, timeout_s=5.0)
    yield c
    c.close()


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def raw_dealer(ctx: zmq.Context[Any], address: str, keys: str) -> zmq.Socket[Any]:
    """A bare DEALER: keys "cluster" (knows the secret), "none" (no CURVE) or "foreign"
    (knows the server's public key but presents a key of its own)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys == "cluster":
        mine = derive_keypair(SECRET, "client")
        sock.curve_publickey, sock.curve_secretkey = mine.public, mine.secret
    elif keys == "foreign":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    if keys != "none":
        sock.curve_serverkey = derive_keypair(SECRET, "server").public
    sock.connect(address)
    return sock


def raw_exchange(sock: zmq.Socket[Any], *frames: bytes, wait_ms: int = 2000) -> bytes | None:
    """Send a (multipart) message and return the reply frame, or None if none came in time."""
    sock.send_multipart(list(frames))
    if not sock.poll(wait_ms):
        return None
    return sock.recv()


ERROR_TYPES = {b"rpc.error": wire.msg_type(wire.ErrorMsg)}


def decode_error(frame: bytes) -> tuple[int, wire.ErrorMsg]:
    """(request id, error) of an error reply frame."""
    kind, req_id, msg = wire.decode_frame(frame, ERROR_TYPES)
    assert kind == wire.KIND_ERROR and isinstance(msg, wire.ErrorMsg), (kind, msg)
    return req_id, msg


def request_frame(msg: Msg, req_id: int = 7) -> bytes:
    return wire.encode_frame(msgspec.msgpack.Encoder(), wire.KIND_REQUEST, req_id, msg)
