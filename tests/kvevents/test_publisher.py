"""The publisher's sockets bound what a peer can make the master hold: a frame larger than
a subscriber ever sends disconnects its sender before any of it is buffered, and the feed
goes on serving subscribers and replay requests."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from mooncake.kvevents.publisher import INBOUND_MAX_BYTES, Publisher
from mooncake.kvevents.wire import END_SEQ, AllBlocksCleared, KVEventBatch
from tests.kvevents.subscriber import Subscriber

BIG_FRAME_BYTES = 1 << 30  # what the peer announces
SENT_BYTES = 64 << 20  # what it then tries to send of it


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    try:
        yield pub
    finally:
        pub.close()


def _zmtp_peer(endpoint: str, socket_type: bytes) -> socket.socket:
    """A raw TCP connection that has passed ZeroMQ's NULL-mechanism handshake (ZMTP 3.0)
    as a `socket_type` socket: the next bytes it sends are message frames."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    # signature, version 3.0, mechanism, as-server, filler: 64 bytes
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
    sock.sendall(greeting)
    _recv_exact(sock, len(greeting))
    prop = b"\x0bSocket-Type" + struct.pack("!I", len(socket_type)) + socket_type
    ready = b"\x05READY" + prop
    sock.sendall(bytes([0x04, len(ready)]) + ready)  # a short command frame
    flags, size = _recv_exact(sock, 2)
    assert flags == 0x04, f"expected the peer's READY command, got flags {flags:#x}"
    _recv_exact(sock, size)
    return sock


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buf = b""
    while len(buf) < num_bytes:
        chunk = sock.recv(num_bytes - len(buf))
        assert chunk, "the publisher closed the connection during the handshake"
        buf += chunk
    return buf


def _send_until_closed(sock: socket.socket, frame_bytes: int, num_bytes: int) -> int:
    """Announce one frame of `frame_bytes` (a long frame header), then send up to
    `num_bytes` of it; returns how many were sent before the publisher closed the
    connection (`num_bytes` if it never did)."""
    sock.sendall(b"\x02" + struct.pack("!Q", frame_bytes))
    chunk, sent = memoryview(bytes(1 << 20)), 0
    try:
        while sent < num_bytes:
            n = min(len(chunk), num_bytes - sent)
            sock.sendall(chunk[:n])
            sent += n
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def _is_closed(sock: socket.socket) -> bool:
    """True once the publisher closed `sock`; False if it is still open 10 s later."""
    sock.settimeout(10.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def _batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[AllBlocksCleared()], data_parallel_rank=n)


@pytest.mark.parametrize(("which", "socket_type"), [("replay", b"DEALER"), ("pub", b"SUB")])
def test_a_frame_over_the_limit_disconnects_its_sender_and_is_never_buffered(
    publisher: Publisher, which: str, socket_type: bytes
) -> None:
    """A peer announcing a 1 GiB frame and sending 64 MiB of it is disconnected after a
    few socket buffers (the master's memory does not grow by the frame); then a
    subscriber still gets live batches and a replay."""
    pub = publisher
    pub.publish([_batch(0)])
    endpoint = pub.replay_endpoint if which == "replay" else pub.endpoint
    before = _rss_bytes()
    peer = _zmtp_peer(endpoint, socket_type)
    sent = _send_until_closed(peer, BIG_FRAME_BYTES, SENT_BYTES)
    assert _is_closed(peer), "the publisher kept the connection of an oversized frame"
    peer.close()
    assert sent < SENT_BYTES, "the publisher read the whole 64 MiB of an oversized frame"
    grown = _rss_bytes() - before
    assert grown < 16 << 20, f"the process grew by {grown} bytes for a refused frame"

    sub = Subscriber(pub.endpoint, pub.replay_endpoint, b"kv")
    try:
        seq = _publish_until_received(pub, sub)
        sub.replay(0)
        assert sub.replayed[: seq + 1] == list(range(seq + 1))
    finally:
        sub.close()


def test_a_frame_at_the_limit_is_read_and_the_connection_goes_on(publisher: Publisher) -> None:
    """The limit refuses only what no subscriber sends: a message of one frame at the
    limit is read (and ignored: not a replay request), and a replay request on the same
    connection is answered."""
    peer = _zmtp_peer(publisher.replay_endpoint, b"DEALER")
    limit = INBOUND_MAX_BYTES + len("kv")
    assert _send_until_closed(peer, limit, limit) == limit
    start = (1 << 62).to_bytes(8, "big")  # after every batch: the answer is the end alone
    peer.sendall(b"\x01\x00" + b"\x00\x08" + start)  # frames "" (more) and the start
    assert [_recv_frame(peer) for _ in range(4)] == [b"", b"", END_SEQ, b""]
    peer.close()


def _recv_frame(sock: socket.socket) -> bytes:
    """The body of the next short message frame ZeroMQ sends on a raw connection."""
    flags, size = _recv_exact(sock, 2)
    assert not flags & 0x06, f"expected a short message frame, got flags {flags:#x}"
    return _recv_exact(sock, size)


def _publish_until_received(pub: Publisher, sub: Subscriber) -> int:
    """A SUB socket receives only after its subscription reached the PUB socket, which
    ZeroMQ does not report: publish a batch until one arrives (at most 10 s); returns the
    sequence number that came."""
    assert sub.sub is not None
    until = time.monotonic() + 10.0
    seq = 1
    while time.monotonic() < until:
        pub.publish([_batch(seq)])
        seq += 1
        if sub.sub.poll(100):
            topic, seq_b, _payload = sub.sub.recv_multipart()
            assert topic == b"kv", topic
            return int.from_bytes(seq_b, "big")
    pytest.fail("a subscriber received no batch after the oversized frame")
