"""Stage frames cross TCP intact, and malformed frames are refused, never unpickled."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from mooncake.errors import TransferError
from mooncake.roles.prefill.group import auth as stageauth
from mooncake.roles.prefill.group.link import (
    HEADER,
    MAGIC,
    FrameKind,
    StageFrame,
    StageTimeoutError,
    TcpStageLink,
    local_link_pair,
)
from mooncake.roles.prefill.group.listener import StageListener
from tests.transfer.test_handshake import _is_closed, _trickle

SECRET = b"stagelink-test-secret-0123"


def _pair() -> tuple[TcpStageLink, TcpStageLink]:
    listener = StageListener(SECRET)
    accepted: list[TcpStageLink] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept(timeout=10)))
    t.start()
    client = TcpStageLink.connect("127.0.0.1", listener.port, SECRET)
    t.join()
    listener.close()
    return client, accepted[0]


def test_frames_of_every_dtype_round_trip_in_order():
    a, b = _pair()
    tensors = [
        torch.randn(3, 5),
        torch.randn(2, 2, 4).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.empty(0, 4),
    ]
    for i, t in enumerate(tensors):
        a.send(StageFrame(FrameKind.CHUNK, 9, index=i, start=100 + i, count=len(t), tensor=t))
    a.send(StageFrame.error(9, "bad block", good_blocks=2, index=1))
    a.close()
    for i, t in enumerate(tensors):
        got = b.recv(timeout=10)
        assert got is not None and got.tensor is not None
        assert (got.kind, got.req_id, got.index, got.start) == (FrameKind.CHUNK, 9, i, 100 + i)
        assert got.tensor.dtype == t.dtype and torch.equal(got.tensor, t)
    err = b.recv(timeout=10)
    assert err is not None and (err.message, err.count, err.index) == ("bad block", 2, 1)
    assert b.recv(timeout=10) is None
    b.close()


def test_a_recv_on_a_silent_link_raises_its_timeout_error_at_the_deadline():
    """A peer that is alive but sends nothing (stopped, or its network dark) closes
    nothing either: recv raises StageTimeoutError (a TransferError) once `timeout` passed,
    on TCP and in-process links alike, so that waiters can tell silence from a close."""
    a, b = _pair()
    local, _ = local_link_pair()
    try:
        for link in (b, local):
            start = time.monotonic()
            with pytest.raises(StageTimeoutError, match="within 0.3 s"):
                link.recv(timeout=0.3)
            assert 0.29 < time.monotonic() - start < 3.0
            assert issubclass(StageTimeoutError, TransferError)
        a.send(StageFrame(FrameKind.END, 3))  # a timeout does not break the link by itself
        got = b.recv(timeout=10)
        assert got is not None and got.req_id == 3
    finally:
        a.close()
        b.close()


def test_closing_a_link_to_a_peer_that_reads_nothing_ends_by_the_timeout():
    """The peer authenticated, then stopped reading (a stopped process): a frame larger
    than the socket buffers cannot be flushed, and close(timeout) cuts the peer off at
    the timeout rather than waiting for it forever."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    peers: list[socket.socket] = []

    def accept() -> None:
        conn, _ = server.accept()
        stageauth.server_handshake(conn, SECRET, time.monotonic() + 10)
        peers.append(conn)  # and never read from it

    t = threading.Thread(target=accept)
    t.start()
    link = TcpStageLink.connect("127.0.0.1", server.getsockname()[1], SECRET)
    t.join()
    try:
        link.send(StageFrame(FrameKind.CHUNK, 1, tensor=torch.zeros(4 << 20)))  # 16 MiB
        start = time.monotonic()
        link.close(timeout=0.5)
        assert 0.45 < time.monotonic() - start < 5.0
        assert link.ended.wait(5)
    finally:
        peers[0].close()
        server.close()


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (HEADER.pack(b"HTTP", 1, 2, 1, 1, 0, 0, 0, 0, 4, 0, 0, 0, 16), "not a v1 stage frame"),
        (HEADER.pack(MAGIC, 1, 99, 1, 1, 0, 0, 0, 0, 4, 0, 0, 0, 16), "bad stage frame header"),
        (HEADER.pack(MAGIC, 1, 2, 1, 1, 0, 0, 0, 0, 4, 0, 0, 0, 15), "does not match"),
        (HEADER.pack(MAGIC, 1, 2, 1, 1, 0, 0, 0, 0, 1 << 30, 0, 0, 0, 1 << 32), "exceeds"),
    ],
)
def test_malformed_frames_fail_the_link_with_a_clear_error(header, message):
    a, b = _pair()
    raw = socket.socket(fileno=a._sock.fileno())  # bypass the sender: write raw bytes
    raw.sendall(header + bytes(16))
    raw.detach()
    with pytest.raises(TransferError, match=message):
        b.recv(timeout=10)
    a.close()
    b.close()


def test_slow_or_silent_peers_neither_hold_up_the_upstream_nor_outlive_the_deadline():
    """While a peer stays silent and another trickles its handshake (a byte every tenth of
    the deadline), the real upstream is accepted and carries frames; with all three
    handshake places taken, one more connection pushes out the oldest (the silent one) and
    is served; the trickling peer is cut off at the deadline, long before its trickle
    would end."""
    deadline_s = 0.5
    listener = StageListener(SECRET, handshake_timeout_s=deadline_s, max_pending_handshakes=3)
    try:
        silent, slow = _in_handshake(listener.port), _in_handshake(listener.port)
        link = TcpStageLink.connect("127.0.0.1", listener.port, SECRET)
        upstream = listener.accept(timeout=10)
        link.send(StageFrame(FrameKind.END, 5))
        got = upstream.recv(timeout=10)
        assert got is not None and (got.kind, got.req_id) == (FrameKind.END, 5)
        silent2 = _in_handshake(listener.port)
        extra = _in_handshake(listener.port)  # served: its HELLO came
        assert _is_closed(silent, 10.0), "the oldest pending connection was not pushed out"
        sent = _trickle(slow, 32 + 32 - 1, deadline_s / 10)  # 63 of its 64 bytes: 3 s
        assert sent < 63, "the listener waited for the whole trickle"
        for s in (extra, slow, silent, silent2):
            s.close()
        link.close()
        upstream.close()
    finally:
        listener.close()


def _in_handshake(port: int) -> socket.socket:
    """A connection the listener has taken into its handshake (its HELLO came)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello_bytes = len(b"MCSL-HELLO-v1") + 32
    assert len(sock.recv(hello_bytes, socket.MSG_WAITALL)) == hello_bytes
    return sock
