"""Unauthenticated peers can neither hold a transfer server's connections nor keep real
peers out: the cluster-secret handshake has one deadline for the whole exchange (not one
per read), and only so many connections may be in it at once, a new one pushing out the
oldest of the address holding the most."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.config.settings import TransferConfig
from mooncake.transfer import EngineOptions, TransferOp, TransferRequest, admission, wire
from mooncake.transfer.segment import SegmentTable
from mooncake.transfer.server import TcpServer
from mooncake.transfer.wire import REQ, RESP, Op, Status
from tests.transfer.conftest import SECRET as ENGINE_SECRET
from tests.transfer.conftest import make_engine
from tests.transfer.peer import pattern

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
    the next client gets in."""
    table, mem, token = segment
    deadline_s = 0.5
    server = TcpServer(table, SECRET, handshake_timeout_s=deadline_s)
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


def _is_dropped(sock: socket.socket) -> bool:
    """True once the server closed `sock` (after its HELLO, if it sent one); False if it
    is still open 10 s later."""
    sock.settimeout(10.0)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _sync(port: int, secret: bytes = SECRET) -> None:
    """Return once the server has admitted every connection dialed before: it accepts in
    order, and this one's handshake completes only after its own admission."""
    wire.connect("127.0.0.1", port, secret, 10.0).close()


def test_idle_connections_beyond_the_budget_cannot_keep_a_real_peer_out() -> None:
    """Three times max_pending_handshakes idle connections from 127.0.0.1 (the address of
    every real peer on `up --local`), with a deadline long enough never to expire: the
    oldest are pushed out, an engine authenticated before the flood goes on transferring,
    and a new engine with the secret connects and transfers byte for byte."""
    limit = 8
    target = make_engine(
        "target", protocol="tcp", max_pending_handshakes=limit, handshake_timeout_s=60.0
    )
    early, late = make_engine("early", protocol="tcp"), make_engine("late", protocol="tcp")
    idle: list[socket.socket] = []
    try:
        pool = target.allocate("pool", 100_000)
        for e in (early, late):
            e.directory.add_peer("127.0.0.1", target.server.port)  # type: ignore[attr-defined]
        src = pattern(30_000)
        early.register("src", src)
        early.transfer([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, 30_000)]).check(5)
        idle = [_dial(target.server.port) for _ in range(3 * limit)]
        _sync(target.server.port, ENGINE_SECRET)
        assert all(_is_dropped(s) for s in idle[: 2 * limit])
        assert target.server.pending.num_dropped == 2 * limit + 1  # and one for _sync's
        target.server.pending.check_integrity()

        more = pattern(30_000, 7)
        early.register("more", more)
        batch = [TransferRequest(TransferOp.WRITE, "more", 0, "pool", 30_000, 30_000)]
        early.transfer(batch).check(5)
        dst = np.zeros(60_000, np.uint8)
        late.register("dst", dst)
        late.transfer([TransferRequest(TransferOp.READ, "dst", 0, "pool", 0, 60_000)]).check(5)
        assert (dst[:30_000] == src).all() and (dst[30_000:] == more).all()
        assert (pool[:60_000] == dst).all()
        target.server.pending.check_integrity()
    finally:
        for s in idle:
            s.close()
        for e in (early, late, target):
            e.close()


def test_a_flood_from_one_address_never_pushes_out_the_handshake_of_another(segment) -> None:
    """A connection from 127.0.0.1 waits in the handshake while 127.0.0.2 opens three
    times max_pending_handshakes idle ones: only 127.0.0.2's are pushed out (oldest
    first), and the first one then completes its handshake and transfers."""
    table, mem, token = segment
    limit = 4
    server = TcpServer(table, SECRET, handshake_timeout_s=60.0, max_pending_handshakes=limit)
    flood: list[socket.socket] = []
    try:
        waiting = _dial(server.port)
        _sync(server.port)  # `waiting` is admitted: the only one pending
        for _ in range(3 * limit):
            flood.append(
                socket.create_connection(
                    ("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0)
                )
            )
        _sync(server.port)
        # the flood fills limit - 1 places, then each of the rest and _sync's drops one
        assert server.pending.num_dropped == 2 * limit + 2
        server.pending.check_integrity()
        assert all(_is_dropped(s) for s in flood[: 2 * limit + 2])
        wire.client_handshake(waiting, SECRET)
        assert _round_trip(waiting, token, b"waited") == b"waited"
        assert bytes(mem[:6]) == b"waited"
        server.pending.check_integrity()
        assert len(server.pending) == 2  # the flood's two newest, waiting for the deadline
        waiting.close()
    finally:
        for s in flood:
            s.close()
        server.close()


def test_the_handshake_settings_default_alike_everywhere() -> None:
    """[transfer] handshake_timeout_s and max_pending_handshakes have one default."""
    cfg, opts = TransferConfig(), EngineOptions()
    assert cfg.handshake_timeout_s == opts.handshake_timeout_s == wire.HANDSHAKE_TIMEOUT_S
    assert cfg.max_pending_handshakes == opts.max_pending_handshakes
    assert cfg.max_pending_handshakes == admission.MAX_PENDING_HANDSHAKES
    got = EngineOptions.from_config(TransferConfig(max_pending_handshakes=3))
    assert got.max_pending_handshakes == 3
