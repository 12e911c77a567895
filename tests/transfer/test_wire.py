"""The TCP data plane's security and robustness: the HMAC handshake gates every access,
malformed or out-of-bounds requests close only their connection, memory stays untouched."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import AuthError
from mooncake.native import dataloop
from mooncake.native.dataloop import library
from mooncake.transfer import wire
from mooncake.transfer.segment import SegmentTable
from mooncake.transfer.server import TcpServer
from mooncake.transfer.wire import REQ, RESP, Op, Status

SECRET = b"wire-test-secret-0123456789abcdef"


@pytest.fixture(params=["native", "python"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[TcpServer, np.ndarray, int]]:
    """A server of one 4 KiB segment, with the C request loop and with the Python one."""
    if request.param == "native" and library() is None:
        pytest.skip("the native data loop was not built (no C compiler at install)")
    table = SegmentTable(native=request.param == "native")
    mem = np.zeros(4096, dtype=np.uint8)
    region = table.register("seg", mem)
    server = TcpServer(table, SECRET)
    try:
        yield server, mem, region.token
    finally:
        server.close()


def _write(sock: socket.socket, token: int, offset: int, data: bytes) -> tuple[int, int]:
    wire.send_all(sock, [REQ.pack(Op.WRITE, 0, 0, 7, token, offset, len(data)), data])
    head = bytearray(RESP.size)
    wire.recv_exact(sock, head)
    status, rid, _ = RESP.unpack(head)
    return status, rid


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the server closed (FIN, or RST because unread data was pending)."""
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def test_authenticated_client_writes_and_reads(served) -> None:
    server, mem, token = served
    sock = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
    assert _write(sock, token, 100, b"hello") == (Status.OK, 7)
    assert bytes(mem[100:105]) == b"hello"
    wire.send_all(sock, [REQ.pack(Op.READ, 0, 0, 8, token, 100, 5)])
    reply = bytearray(RESP.size + 5)
    wire.recv_exact(sock, reply)
    assert RESP.unpack_from(reply) == (Status.OK, 8, 5) and reply[RESP.size :] == b"hello"
    sock.close()


def test_wrong_secret_is_refused_before_any_memory_access(served) -> None:
    server, mem, token = served
    with pytest.raises((AuthError, ConnectionError, OSError)):
        sock = wire.connect("127.0.0.1", server.port, b"not-the-cluster-secret-0000", 5.0)
        _write(sock, token, 0, b"evil")
    assert not mem.any()


def test_client_skipping_the_handshake_cannot_write(served) -> None:
    server, mem, token = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        wire.recv_exact(sock, bytearray(wire.HELLO.size))
        sock.sendall(
            REQ.pack(Op.WRITE, 0, 0, 1, token, 0, 4).ljust(wire.AUTH.size, b"\0") + b"evil"
        )
        assert _closed_by_peer(sock)  # closed without a proof
    assert not mem.any()


@pytest.mark.parametrize(
    "header",
    [
        REQ.pack(99, 0, 0, 1, 0, 0, 0),
        REQ.pack(Op.WRITE, 0, 0, 1, 0, 0, wire.MAX_DATA_BYTES + 1),
        REQ.pack(Op.DESCRIBE, 0, 0, 1, 0, 0, wire.MAX_CONTROL_BYTES + 1),
    ],
    ids=["unknown-op", "oversized-slice", "oversized-control"],
)
def test_malformed_header_closes_only_that_connection(served, header: bytes, caplog) -> None:
    server, mem, token = served
    bad = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
    bad.sendall(header)
    assert _closed_by_peer(bad)
    assert "malformed request" in caplog.text
    good = wire.connect("127.0.0.1", server.port, SECRET, 5.0)  # the server keeps serving
    assert _write(good, token, 0, b"ok") == (Status.OK, 7)
    good.close()
    bad.close()


@pytest.mark.parametrize(("offset", "length"), [(4090, 10), (-1 & (2**64 - 1), 4), (0, 0)])
def test_out_of_bounds_write_is_rejected_and_writes_nothing(
    served, offset: int, length: int
) -> None:
    server, mem, token = served
    sock = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
    status, _ = _write(sock, token, offset, b"x" * length)
    assert status == Status.OUT_OF_BOUNDS
    assert _closed_by_peer(sock)  # closed: the payload is never read into memory
    assert not mem.any()
    sock.close()


def test_unknown_token_is_no_segment(served) -> None:
    server, _, token = served
    sock = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
    assert _write(sock, token + 1, 0, b"x")[0] == Status.NO_SEGMENT
    sock.close()


def test_pipelined_requests_are_answered_in_order_when_the_last_asks_to_flush(served) -> None:
    """Requests without FLAG_FLUSH are queued; the one carrying it sends every reply, in
    request order (and a lone request with it is answered at once)."""
    server, mem, token = served
    mem[:6] = np.frombuffer(b"abcdef", np.uint8)
    sock = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
    reqs = [
        REQ.pack(Op.READ, wire.FLAG_FLUSH if i == 2 else 0, 0, 20 + i, token, 2 * i, 2)
        for i in range(3)
    ]
    wire.send_all(sock, reqs)
    reply = bytearray(3 * (RESP.size + 2))
    wire.recv_exact(sock, reply)
    step = RESP.size + 2
    for i in range(3):
        assert RESP.unpack_from(reply, i * step) == (Status.OK, 20 + i, 2)
        assert reply[i * step + RESP.size : (i + 1) * step] == b"abcdef"[2 * i : 2 * i + 2]
    assert _write(sock, token, 0, b"Z") == (Status.OK, 7)  # flags 0: answered after a probe
    sock.close()


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A tuned loopback TCP connection: (reader, writer)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname()[:2])
        reader, _ = listener.accept()
    wire.tune(reader, 5.0)
    try:
        yield reader, writer
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.002])
def test_one_receive_takes_what_came_polled_or_not(tcp_pair, spin_s: float) -> None:
    """recv_some returns the bytes that came (up to the buffer), sleeps in the kernel once
    the spin is over, and reports EOF as 0."""
    import threading

    reader, writer = tcp_pair
    buf = bytearray(8)
    writer.sendall(b"abc")
    assert bytes(buf[: wire.recv_some(reader, buf, spin_s)]) == b"abc"
    later = threading.Timer(0.05, writer.sendall, args=(b"0123456789",))  # after the spin
    later.start()
    assert wire.recv_some(reader, buf, spin_s) == 8 and bytes(buf) == b"01234567"  # waited
    later.join()
    writer.shutdown(socket.SHUT_WR)
    assert wire.recv_some(reader, buf, spin_s) == 2 and wire.recv_some(reader, buf, spin_s) == 0


@pytest.mark.parametrize("spin_s", [0.0, 0.0005, 0.05])
def test_a_reply_in_pieces_lands_whole_with_or_without_polling(tcp_pair, spin_s: float) -> None:
    """Pieces that come within the spin and after it (sleeping in the kernel for the rest)
    are scattered in order over the buffers; EOF first returns what came."""
    import threading
    import time

    reader, writer = tcp_pair
    data = bytes(range(256)) * 40

    def send_in_pieces() -> None:
        for i, cut in enumerate((0, 7, 5000, len(data))[:-1]):
            time.sleep(0.001 * i * i)
            writer.sendall(data[cut : (7, 5000, len(data))[i]])

    bufs = [memoryview(bytearray(n)) for n in (3, 9000, len(data) - 9003)]
    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    got = wire.recv_until_eof(reader, bufs, spin_s)
    sender.join()
    assert got == len(data) and b"".join(bytes(b) for b in bufs) == data
    writer.sendall(b"xy")
    writer.shutdown(socket.SHUT_WR)
    tail = [memoryview(bytearray(10))]
    assert wire.recv_until_eof(reader, tail, spin_s) == 2 and bytes(tail[0][:2]) == b"xy"


def test_the_native_loops_wire_constants_are_the_wires() -> None:
    assert (REQ.size, wire.MAX_DATA_BYTES) == (dataloop.REQ_BYTES, dataloop.MAX_DATA_BYTES)


@pytest.mark.skipif(library() is None, reason="the native data loop was not built")
def test_unregister_frees_a_native_loop_stuck_on_a_stalled_writer() -> None:
    """A peer sends a WRITE's header and part of its payload, then stalls, while the C loop
    holds the segment: unregistering it drops the connections that hold it (after a
    bounded wait), completes, and later requests for it are refused. (The Python loop
    does not wait: its memoryview keeps the memory alive.)"""
    table = SegmentTable(native=True)
    token = table.register("seg", np.zeros(4096, dtype=np.uint8)).token
    server = TcpServer(table, SECRET)
    try:
        stalled = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
        wire.send_all(stalled, [REQ.pack(Op.WRITE, 0, 0, 1, token, 0, 4096), b"x" * 100])
        good = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
        assert _write(good, token, 200, b"ok")[0] == Status.OK  # served beside it
        table.unregister("seg")
        assert _closed_by_peer(stalled)
        late = wire.connect("127.0.0.1", server.port, SECRET, 5.0)
        assert _write(late, token, 0, b"no")[0] == Status.NO_SEGMENT
        for sock in (stalled, good, late):
            sock.close()
    finally:
        server.close()
