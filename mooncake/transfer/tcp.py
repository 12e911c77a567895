"""The TCP transport: one-sided reads and writes against a peer's `TcpServer`.

A path is one (local NIC, remote endpoint) pair with `connections_per_peer` worker threads,
each owning one authenticated connection. A worker takes up to `group_bytes` of queued
slices, sends all their headers (and WRITE payloads) with one sendmsg straight from the
registered memory, then scatters the replies with recvmsg_into into the registered memory:
no intermediate bytes objects, and the socket calls release the GIL while the kernel
copies. Adjacent slices travel as one wire request. A broken connection fails its slices
as retryable and is re-opened on the next use.

TransferEngine.transfer() runs on the caller's thread instead (run_inline, move_now), over
connections kept idle for it: no queue, no worker wake-up, no completion hand-off. The
last request before a wait carries FLAG_FLUSH, so the server answers without a probe.
The caller's thread awaits replies by polling for up to `spin_us` before it sleeps
(wire.recv_until_eof); the workers sleep at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator, Mapping

import mooncake.transfer.wire as wire
from mooncake.errors import MooncakeError, ProtocolError
from mooncake.transfer.batch import Slice, chunked, contiguous_runs
from mooncake.transfer.paths import Path
from mooncake.transfer.transport import BaseTransport, Report, Target
from mooncake.transfer.types import EngineOptions, SegmentDesc, TransferOp
from mooncake.transfer.wire import FLAG_FLUSH, REQ, RESP, Op, Status

log = logging.getLogger(__name__)

MAX_GROUP_SLICES = 64
_OK = int(Status.OK)
_Conn = tuple[socket.socket, Iterator[int]]  # an authenticated connection, its request ids
_Started = tuple[_Conn, int]  # a connection with one request in flight, and its id


class TcpPath(Path):
    """Connections to one endpoint of a peer, fed from one queue."""

    def __init__(
        self,
        transport: TcpTransport,
        host: str,
        port: int,
        remote_nic: str,
        local_nic: str = "",
        source_ip: str = "",
    ):
        via = f" via {local_nic}" if local_nic else ""
        opts = transport.options
        super().__init__(
            f"tcp {host}:{port}{via}",
            local_nic,
            remote_nic,
            opts.pause_after_failures,
            opts.pause_s,
        )
        self.host, self.port = host, port
        self._transport = transport
        self._source = (source_ip, 0) if source_ip else None
        self._queue: queue.SimpleQueue[list[Slice] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._idle: list[_Conn] = []  # connections of inline callers, not in use
        self._lock = threading.Lock()
        self._closed = False
        self._spin_s = opts.spin_us * 1e-6  # polling for a reply before sleeping

    def dispatch(self, slices: list[Slice]) -> None:
        """Queue `slices` in chunks of at most group_bytes (one chunk = one queue item)."""
        if not self._threads:
            self._start()
        for chunk in chunked(slices, self._transport.options.group_bytes, MAX_GROUP_SLICES):
            self._queue.put(chunk)

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            n = self._transport.options.connections_per_peer
            self._threads = [
                threading.Thread(target=self._work, name=f"te-tcp-{self.port}-{i}", daemon=True)
                for i in range(n)
            ]
            for t in self._threads:
                t.start()

    def _connect(self) -> socket.socket:
        opts = self._transport.options
        timeout = opts.slice_io_timeout_s
        sock = socket.create_connection((self.host, self.port), timeout, self._source)
        try:
            wire.tune(sock, timeout)
            wire.client_handshake(sock, self._transport.secret)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._socks.add(sock)
        return sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def run_inline(self, slices: list[Slice]) -> None:
        """Move `slices` on the calling thread over an idle connection of this path (its
        first group; further groups go to the workers), reporting each slice exactly as the
        workers do. Saves the two thread hand-offs of a queued group: the fixed cost of a
        small synchronous transfer."""
        group = slices
        if len(slices) > 1:
            chunks = chunked(slices, self._transport.options.group_bytes, MAX_GROUP_SLICES)
            if len(chunks) > 1:
                if not self._threads:
                    self._start()
                for chunk in chunks[1:]:
                    self._queue.put(chunk)
            group = [s for s in chunks[0] if s.batch.is_live(s.index)]
            if not group:
                return
        try:
            conn: _Conn | None = self._idle.pop()  # NOTE: list.pop/append are atomic
        except IndexError:
            conn = None
        conn = self._move(conn, group, self._spin_s)
        if conn is not None:
            self._idle.append(conn)  # close() shuts every socket down, idle ones included

    def _work(self) -> None:
        q = self._queue
        group_bytes = self._transport.options.group_bytes
        conn: _Conn | None = None
        while (chunk := q.get()) is not None:
            group = list(chunk)
            num_bytes = sum(s.length for s in group)
            while num_bytes < group_bytes and len(group) < MAX_GROUP_SLICES:
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    q.put(None)
                    break
                group += more
                num_bytes += sum(s.length for s in more)
            group = [g for g in group if g.batch.is_live(g.index)]
            if group:
                conn = self._move(conn, group)
        if conn is not None:
            self._drop(conn[0])

    def _move(self, conn: _Conn | None, group: list[Slice], spin_s: float = 0.0) -> _Conn | None:
        """Run `group` over `conn` (connecting if None) and report every slice; returns the
        connection, or None if it broke (its slices are reported as retryable). `spin_s`:
        polling for the replies before sleeping, on a caller's thread only (a worker that
        polled would take the GIL from the compute it is meant to overlap)."""
        report = self._transport.report
        if self.is_paused():  # hand them back at once: the engine re-routes them
            for g in group:
                report(g, f"{self.key}: path paused after repeated failures", True)
            return conn
        done = 0
        try:
            if conn is None:
                conn = (self._connect(), itertools.count(1))
            if len(group) == 1:
                done = self._run_one(conn[0], group[0], next(conn[1]) & 0xFFFFFFFF, spin_s)
            else:
                done = self._run_group(conn[0], group, conn[1], spin_s)
            return conn
        except (OSError, MooncakeError) as e:
            if conn is not None:
                self._drop(conn[0])
            why = f"{self.key}: {type(e).__name__}: {e}"
            if isinstance(e, BlockingIOError | TimeoutError):  # SO_RCVTIMEO / SO_SNDTIMEO
                limit = self._transport.options.slice_io_timeout_s
                why = f"{self.key}: no progress within {limit:g} s"
            for g in group[done:]:
                report(g, why, True)
            return None

    def move_now(self, op: TransferOp, mem: memoryview, token: int, remote_offset: int) -> bool:
        """Move `mem` to or from [remote_offset, +len(mem)) of the remote segment `token` on
        the calling thread over an idle connection: no Slice, no queue, no report. False if
        it did not work out (paused path, broken connection, a refusal): nothing is
        recorded, and the caller moves it again the general way, which retries and
        reports. A repeat is harmless: a read or write of the same bytes."""
        started = self.start_now(op, mem, token, remote_offset, connect=True)
        return started is not None and self.finish_now(started, op, mem)

    def start_now(
        self, op: TransferOp, mem: memoryview, token: int, remote_offset: int, connect: bool = False
    ) -> _Started | None:
        """The first half of move_now(): send the request, and hold its connection until
        finish_now() takes the reply (other work may happen between the two). None if
        nothing was sent: the path is paused, the send failed, or no connection is idle and
        `connect` is False (a connect to a dead host can take seconds)."""
        if self.is_paused():
            return None
        try:
            conn: _Conn | None = self._idle.pop()  # NOTE: list.pop/append are atomic
        except IndexError:
            conn = None
        try:
            if conn is None:
                if not connect:
                    return None
                conn = (self._connect(), itertools.count(1))
            rid = next(conn[1]) & 0xFFFFFFFF
            wire.send_request(conn[0], op, mem, token, remote_offset, rid)
            return conn, rid
        except (OSError, MooncakeError):
            if conn is not None:
                self._drop(conn[0])
            return None

    def abandon_now(self, started: _Started) -> None:
        """Give up on the request start_now() sent: its connection is closed unread (the
        reply would be waited for in vain if the node is gone; a node that is there sees
        the connection end)."""
        self._drop(started[0][0])

    def finish_now(self, started: _Started, op: TransferOp, mem: memoryview) -> bool:
        """The second half of move_now(): wait for the reply of the request start_now()
        sent (polling up to spin_us first); False if it failed, as move_now()."""
        conn, rid = started
        try:
            if wire.recv_reply(conn[0], op, mem, rid, self._spin_s) == _OK:
                self.record_success(len(mem))
                self._idle.append(conn)  # close() shuts every socket down, idle ones too
                return True
        except (OSError, MooncakeError):
            pass
        self._drop(conn[0])  # NOTE: the server closes it after a refusal anyway
        return False

    def _run_one(self, sock: socket.socket, s: Slice, rid: int, spin_s: float) -> int:
        """_run_group() of a group of one slice, in fewer steps (the small transfer's path)."""
        mem = s.local.view.mv[s.local_offset : s.local_offset + s.length]
        wire.send_request(sock, s.op, mem, s.target.desc.token, s.remote_offset, rid)
        status = wire.recv_reply(sock, s.op, mem, rid, spin_s)
        if status != _OK:  # the server closes the connection after an error
            self._transport.report(s, f"{self.key}: {wire.status_text(status)}", False)
        else:
            self._transport.report_done([s])
        return 1

    def _run_group(
        self, sock: socket.socket, group: list[Slice], req_ids: Iterator[int], spin_s: float
    ) -> int:
        """Send every slice of `group` (one sendmsg), then scatter every reply (status
        headers, READ data straight into the registered memory) with as few recvmsg_into
        calls as the kernel allows; returns how many slices were reported. Raises
        OSError/ProtocolError for the slices not reported (the caller retries them).

        Slices that continue each other on both sides (same op, local and remote segment,
        adjacent offsets) travel as one wire request: one header and one reply for a run of
        slices, so a request cut into small slices costs the server one read, not many."""
        runs = contiguous_runs(group)
        iov: list[bytes | memoryview] = []
        rx: list[memoryview] = []
        heads = bytearray(RESP.size * len(runs))
        hv = memoryview(heads)
        ids, lengths = [], []
        for i, run in enumerate(runs):
            first = run[0]
            length = sum(s.length for s in run) if len(run) > 1 else first.length
            rid = next(req_ids) & 0xFFFFFFFF
            ids.append(rid)
            lengths.append(length)
            token = first.target.desc.token
            flags = FLAG_FLUSH if i == len(runs) - 1 else 0  # then the replies, please
            iov.append(REQ.pack(first.op, flags, 0, rid, token, first.remote_offset, length))
            mem = first.local.view.mv[first.local_offset : first.local_offset + length]
            head = hv[i * RESP.size : (i + 1) * RESP.size]
            if first.op is TransferOp.WRITE:
                iov.append(mem)
                rx.append(head)
            else:
                rx += (head, mem)
        wire.send_all(sock, iov)
        got = wire.recv_until_eof(sock, rx, spin_s)
        pos = reported = 0
        for i, run in enumerate(runs):
            if got - pos < RESP.size:
                raise ConnectionError(f"connection closed with {len(runs) - i} replies missing")
            status, rid, length = RESP.unpack_from(heads, i * RESP.size)
            pos += RESP.size
            if rid != ids[i]:
                raise ProtocolError(f"reply for request {rid}, expected {ids[i]}")
            if status != Status.OK:  # the server closes the connection after an error
                if reported:
                    self._transport.report_done(group[:reported])
                why = f"{self.key}: {wire.status_text(status)}"
                for s in run:
                    self._transport.report(s, why, False)
                return reported + len(run)
            if run[0].op is TransferOp.READ:
                if length != lengths[i]:
                    raise ProtocolError(f"read reply of {length} bytes, expected {lengths[i]}")
                if got - pos < length:
                    raise ConnectionError("connection closed in the middle of a read reply")
                pos += length
            reported += len(run)
        self._transport.report_done(group)
        return len(group)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = list(self._socks)
            self._idle.clear()
        for _ in self._threads:
            self._queue.put(None)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class TcpTransport(BaseTransport):
    """Reaches any peer whose segment advertises TCP endpoints."""

    name = "tcp"
    coalesces = True

    def __init__(
        self,
        report: Report,
        report_done: Callable[[list[Slice]], None],
        secret: bytes,
        options: EngineOptions,
        nic_addresses: Mapping[str, str] | None = None,
    ):
        super().__init__(report)
        self.report_done = report_done
        self.secret = secret
        self.options = options
        self._nic_addresses = dict(nic_addresses or {})  # local NIC -> source IP to bind
        self._paths: dict[tuple[str, int, str], TcpPath] = {}
        self._lock = threading.Lock()

    def can_reach(self, desc: SegmentDesc) -> bool:
        return bool(desc.endpoints)

    def open(self, desc: SegmentDesc) -> Target:
        return Target(desc, self)

    def paths(self, target: Target) -> list[Path]:
        locals_ = list(self._nic_addresses.items()) or [("", "")]
        out: list[Path] = []
        with self._lock:
            for ep in target.desc.endpoints:
                for nic, ip in locals_:
                    key = (ep.host, ep.port, nic)
                    if key not in self._paths:
                        self._paths[key] = TcpPath(self, ep.host, ep.port, ep.nic, nic, ip)
                    out.append(self._paths[key])
        return out

    def all_paths(self) -> list[TcpPath]:
        with self._lock:
            return list(self._paths.values())

    def close(self) -> None:
        for p in self.all_paths():
            p.close()


def control_call(
    host: str, port: int, secret: bytes, op: Op, payload: bytes, timeout_s: float
) -> tuple[Status, bytes]:
    """One control request (DESCRIBE, RDMA_CONNECT) on a fresh authenticated connection."""
    sock = wire.connect(host, port, secret, timeout_s)
    try:
        wire.send_all(sock, [REQ.pack(op, FLAG_FLUSH, 0, 1, 0, 0, len(payload)), payload])
        head = bytearray(RESP.size)
        wire.recv_exact(sock, head)
        status, _rid, length = RESP.unpack(head)
        if length > wire.MAX_CONTROL_BYTES:
            raise ProtocolError(f"control reply of {length} bytes is too large")
        body = bytearray(length)
        wire.recv_exact(sock, body)
        if status not in Status._value2member_map_:
            raise ProtocolError(f"control reply with unknown status {status}")
        return Status(status), bytes(body)
    finally:
        sock.close()
