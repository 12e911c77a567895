"""The ceilings `mooncake bench transfer` compares against, measured in the same run and
interleaved with the transfer windows so both see the same machine load: a plain Python
socket stream between two processes (tcp, rdma) and a single-threaded memcpy (shm).

Both move bytes between buffers of one batch's size (`span_bytes` = batch x block), as the
transfer does: a stream that reuses one cache-hot 1 MiB buffer on each side would measure
the cache, not the memory the transfer has to read and write."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import struct
import time
from multiprocessing.connection import Connection

import numpy as np

from mooncake.transfer import wire

_COUNT = struct.Struct("!Q")


def _sink(conn: Connection, span_bytes: int) -> None:
    """Accept streams one after another, receiving into a `span_bytes` buffer round and
    round; after each EOF answer the byte count on the connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    buf = memoryview(np.ones(span_bytes, np.uint8))  # type: ignore[arg-type]
    chunk = min(span_bytes, 1 << 20)
    pos = 0
    while True:
        sock, _ = srv.accept()
        wire.tune(sock)
        total = 0
        while n := sock.recv_into(buf[pos : pos + chunk]):
            total += n
            pos = (pos + n) % (span_bytes - chunk + 1)
        if total == 0:  # an empty stream: the end
            sock.close()
            return
        sock.sendall(_COUNT.pack(total))
        sock.close()


class StreamBaseline:
    """sendall of `block_bytes` chunks, taken in turn from a `span_bytes` buffer, to a
    receiver process that recv_into a `span_bytes` buffer in turn; both sockets tuned as
    the tcp transport's (TCP_NODELAY, 4 MiB buffers)."""

    name = "socket-stream"

    def __init__(self, block_bytes: int, span_bytes: int):
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sink, args=(child, span_bytes), daemon=True)
        self._proc.start()
        child.close()
        if not parent.poll(30):
            self._proc.kill()
            raise RuntimeError("socket-stream baseline receiver did not start")
        self._port = parent.recv()
        self._data = memoryview(np.ones(max(span_bytes, block_bytes), np.uint8))  # type: ignore[arg-type]
        self._block = block_bytes
        self._k = 0

    def run(self, seconds: float) -> tuple[int, float]:
        """Stream for `seconds`; (bytes the receiver confirmed, seconds until it had them)."""
        sock = socket.create_connection(("127.0.0.1", self._port))
        wire.tune(sock)
        sent, data, block = 0, self._data, self._block
        n = len(data) // block
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            off = (self._k % n) * block
            sock.sendall(data[off : off + block])
            sent += block
            self._k += 1
        sock.shutdown(socket.SHUT_WR)
        reply = bytearray(_COUNT.size)
        wire.recv_exact(sock, reply)
        elapsed = time.perf_counter() - t0
        sock.close()
        (received,) = _COUNT.unpack(reply)
        assert received == sent, (received, sent)
        return sent, elapsed

    def close(self) -> None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self._port)):
            pass  # an empty stream tells the receiver to exit
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()


class MemcpyBaseline:
    """Single-threaded numpy copies of `block_bytes` between two `span_bytes` arrays."""

    name = "memcpy"

    def __init__(self, block_bytes: int, span_bytes: int):
        self._src = np.ones(span_bytes, np.uint8)
        self._dst = np.ones(span_bytes, np.uint8)  # touched: no page faults in the timing
        self._block = block_bytes
        self._k = 0

    def run(self, seconds: float) -> tuple[int, float]:
        n = max(1, len(self._src) // self._block)
        copied, block = 0, self._block
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop:
            off = (self._k % n) * block
            np.copyto(self._dst[off : off + block], self._src[off : off + block])
            copied += block
            self._k += 1
        return copied, time.perf_counter() - t0

    def close(self) -> None:
        pass
