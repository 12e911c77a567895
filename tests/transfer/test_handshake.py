"""Unauthenticated peers cannot hold a transfer server's connections: the cluster-secret
handshake has one deadline for the whole exchange (not one per read), and only so many
connections from one address may be in it at once."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.config import TransferConfig
from mooncake.transfer import EngineOptions, wire
from mooncake.transfer.segment import SegmentTable
from mooncake.transfer.server import TcpServer
from mooncake.transfer.wire import REQ, RESP, Op, Status

SECRET = b"handshake-test-secret-0123456789"


@pytest.fixture
def segment() -> Iterator[tuple[SegmentTable, np.ndarray, int]]:
    table = SegmentTable(native=False)
    mem = np.zeros(4096, dtype=np.uint8)
    yield table, mem, table.register("seg", mem).token


def _dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _is_closed(sock: socket.socket, wait_s: float) -> bool:
    """True once the server closed the connection (EOF or reset), waiting up to `wait_s`
    for it; False if it is still open (what it sent, if anything, is left unread)."""
    if not select.select([sock], [], [], wait_s)[0]:
        return False
    try:
        return sock.recv(64, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def _trickle(sock: socket.socket, num_bytes: int, gap_s: float) -> int:
    """Send up to `num_bytes` bytes one at a time, `gap_s` apart (a slow-loris client);
    returns how many were sent before the server closed the connection."""
    for sent in range(num_bytes):
        if _is_closed(sock, gap_s):
            return sent
        try:
            sock.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            return sent
    return num_bytes


def _round_trip(sock: socket.socket, token: int, data: bytes) -> bytes:
    """WRITE `data` at offset 0 and READ it back on an authenticated connection."""
    wire.send_all(sock, [REQ.pack(Op.WRITE, wire.FLAG_FLUSH, 0, 1, token, 0, len(data)), data])
    head = bytearray(RESP.size)
    wire.recv_exact(sock, head)
    assert RESP.unpack(head)[0] == Status.OK
    wire.send_all(sock, [REQ.pack(Op.READ, wire.FLAG_FLUSH, 0, 2, token, 0, len(data))])
    reply = bytearray(RESP.size + len(data))
    wire.recv_exact(sock, reply)
    assert RESP.unpack_from(reply)[0] == Status.OK
    return bytes(reply[RESP.size :])


def test_a_peer_trickling_its_handshake_is_cut_off_at_the_deadline(segment) -> None:
    """One byte every tenth of the deadline: every read is in time, the whole handshake is
    not. The server closes the connection long before the trickle would have ended, and
    its slot is free again (the bound is 1: the next client gets in)."""
    table, mem, token = segment
    deadline_s = 0.5
    server = TcpServer(table, SECRET, handshake_timeout_s=deadline_s, max_handshakes_per_peer=1)
    try:
        slow = _dial(server.port)
        wire.recv_exact(slow, bytearray(wire.HELLO.size))
        # 71 of the 72 AUTH bytes would take 7 s; each gap is a tenth of the deadline
        sent = _trickle(slow, wire.AUTH.size - 1, deadline_s / 10)
        assert sent < wire.AUTH.size - 1, "the server waited for the whole trickle"
        slow.close()
        sock = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
        assert _round_trip(sock, token, b"after") == b"after"
        sock.close()
    finally:
        server.close()


def test_more_unauthenticated_connections_from_one_address_than_the_bound_are_refused(
    segment,
) -> None:
    """Three silent connections hold the three handshake slots of 127.0.0.1: a fourth is
    closed at once (no HELLO), while an authenticated connection keeps working; once a
    silent one leaves, a new client authenticates again."""
    table, mem, token = segment
    server = TcpServer(table, SECRET, handshake_timeout_s=60.0, max_handshakes_per_peer=3)
    silent: list[socket.socket] = []
    try:
        authed = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
        for _ in range(3):
            s = _dial(server.port)
            wire.recv_exact(s, bytearray(wire.HELLO.size))  # accepted: it holds a slot
            silent.append(s)
        extra = _dial(server.port)
        assert _is_closed(extra, 10.0), "a fourth unauthenticated connection was served"
        extra.close()
        assert _round_trip(authed, token, b"still works") == b"still works"
        assert bytes(mem[:11]) == b"still works"
        silent.pop().close()
        # NOTE: the server frees the slot when its thread sees the EOF: poll for it
        for _attempt in range(100):
            probe = _dial(server.port)
            if not _is_closed(probe, 10.0):  # a HELLO (served) or EOF (refused) comes
                break
            probe.close()
        else:
            pytest.fail("the slot of a closed unauthenticated connection was never freed")
        wire.client_handshake(probe, SECRET)
        assert _round_trip(probe, token, b"new") == b"new"
        probe.close()
        authed.close()
    finally:
        for s in silent:
            s.close()
        server.close()


def test_the_handshake_settings_default_alike_everywhere() -> None:
    """[transfer] handshake_timeout_s and max_handshakes_per_peer have one default."""
    cfg, opts = TransferConfig(), EngineOptions()
    assert cfg.handshake_timeout_s == opts.handshake_timeout_s == wire.HANDSHAKE_TIMEOUT_S
    assert cfg.max_handshakes_per_peer == opts.max_handshakes_per_peer
    assert cfg.max_handshakes_per_peer == wire.MAX_HANDSHAKES_PER_PEER
    got = EngineOptions.from_config(TransferConfig(handshake_timeout_s=1.5))
    assert got.handshake_timeout_s == 1.5
