"""The per-node TCP server: one-sided reads and writes of registered segments, and the
handshake (segment descriptors, RDMA queue-pair exchange) that peers use without a master.

One thread per connection; a connection is served only after it passes the cluster-secret
handshake, which must finish within `handshake_timeout_s` in all; at most
`max_pending_handshakes` connections may be in the handshake at once, a new one pushing out
the oldest of the address holding the most (`admission.PendingHandshakes`), so unauthenticated
peers can neither hold threads nor keep authenticated ones out. Replies are
queued and sent together when the client says it waits (FLAG_FLUSH on its last request)
or has nothing more in flight, so a group of slices costs one reply syscall. A malformed
header closes that connection with a logged error; the server goes on serving the others.
When the C loop was built (native/dataloop.py), READ and WRITE requests are served by it
with the GIL released, and everything else comes back here.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

import mooncake.transfer.admission as admission
import mooncake.transfer.wire as wire
from mooncake.config.portrange import PortRange, listen
from mooncake.errors import MooncakeError
from mooncake.transfer.segment import Region, SegmentTable
from mooncake.transfer.staging import Stager
from mooncake.transfer.wire import REQ, RESP, Op, Status

if TYPE_CHECKING:
    from mooncake.native.dataloop import SegmentIndex

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
FLUSH_BYTES = 512 << 10  # send queued READ replies once they reach this many bytes
_READ, _WRITE, _OK, _FLUSH = int(Op.READ), int(Op.WRITE), int(Status.OK), wire.FLAG_FLUSH
# payload -> (status, reply payload); runs on the connection's thread
ControlHandler = Callable[[bytes], tuple[Status, bytes]]


def _done() -> None:
    return None


class _Closing(Exception):
    """This connection must be closed (reason already logged)."""


class TcpServer:
    """Serves `segments` on host:port to clients that know `secret`; `port` is one port
    (0 picks any) or a PortRange to take the first free port of ([node] port_range)."""

    def __init__(
        self,
        segments: SegmentTable,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int | PortRange = 0,
        *,
        handshake_timeout_s: float = wire.HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = admission.MAX_PENDING_HANDSHAKES,
        stager: Stager | None = None,  # serves device segments through host memory
    ):
        self.segments = segments
        self._stager = stager
        self.handshake_timeout_s = handshake_timeout_s
        self.pending = admission.PendingHandshakes(
            max_pending_handshakes, "transfer server", handshake_timeout_s
        )
        segments.on_stuck = self.drop_connections  # frees a native loop held by a stalled peer
        self.handlers: dict[Op, ControlHandler] = {}  # DESCRIBE, RDMA_CONNECT
        self._secret = secret
        self._listener = listen(host, port, backlog=128)
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="te-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                break
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    log.warning(
                        "transfer server: refusing %s (closed or too many connections)", addr
                    )
                    sock.close()
                    continue
                self._conns.add(sock)
            self.pending.admit(sock, addr[0])
            threading.Thread(
                target=self._serve, args=(sock, addr), name="te-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            # NOTE: no kernel timeouts: the handshake has a deadline of its own, and
            # authenticated connections may then wait idle indefinitely
            try:
                wire.tune(sock, 0.0)
                wire.server_handshake(sock, self._secret, self.handshake_timeout_s)
            finally:
                if not self.pending.finish(sock):
                    raise _Closing  # dropped to admit a newer connection (logged)
            self._loop(sock, peer)
        except MooncakeError as e:
            log.warning("transfer server: rejected %s: %s", peer, e)
        except _Closing:
            pass
        except OSError as e:
            log.debug("transfer server: connection %s ended: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _loop(self, sock: socket.socket, peer: str) -> None:
        index = self.segments.native
        if index is not None:
            return self._native_loop(sock, peer, index)
        hdr = bytearray(REQ.size)
        pending: list[bytes | memoryview] = []  # replies not yet sent
        pending_bytes = 0
        while True:
            got = 0
            if pending:  # no FLAG_FLUSH: send once the client has nothing more in flight
                try:
                    got = sock.recv_into(hdr, REQ.size, socket.MSG_DONTWAIT)
                    if got == 0:
                        return
                except BlockingIOError:
                    wire.send_all(sock, pending)
                    pending, pending_bytes = [], 0
            if got == 0:
                if not self._recv_header(sock, hdr):
                    return
            elif got < REQ.size:
                wire.recv_exact(sock, memoryview(hdr)[got:])
            flags, added = self._request(sock, peer, hdr, pending)
            pending_bytes += added
            if flags & _FLUSH or pending_bytes >= FLUSH_BYTES:
                wire.send_all(sock, pending)
                pending, pending_bytes = [], 0

    def _native_loop(self, sock: socket.socket, peer: str, index: SegmentIndex) -> None:
        """The C loop serves READ/WRITE requests (native/dataloop.py); whatever it hands
        back (control ops, refusals, segments it does not hold) is answered here, one
        request at a time."""
        fd = sock.fileno()
        while True:
            rc, hdr = index.serve(fd)
            if rc == 0:
                return
            if rc < 0:
                raise ConnectionError("the connection broke in the native data loop")
            pending: list[bytes | memoryview] = []
            self._request(sock, peer, hdr, pending)
            wire.send_all(sock, pending)

    def _request(
        self,
        sock: socket.socket,
        peer: str,
        hdr: bytes | bytearray,
        pending: list[bytes | memoryview],
    ) -> tuple[int, int]:
        """Serve the request whose header is `hdr` (reading its payload), queueing its
        reply on `pending`; returns (its flags, bytes of READ data queued). Raises
        _Closing after a refusal or a malformed request (the reason logged)."""
        op, flags, _pad, req_id, token, offset, length = REQ.unpack(hdr)
        added = 0
        if op in (_READ, _WRITE):
            if length > wire.MAX_DATA_BYTES:
                self._malformed(peer, f"slice length {length} > {wire.MAX_DATA_BYTES}")
            status, region = self._access(token, offset, length)
            if region is None:
                log.warning(
                    "transfer server: %s request %d from %s refused: %s",
                    Op(op).name,
                    req_id,
                    peer,
                    status.name,
                )
                # NOTE: close after any error reply: a WRITE's payload is on the wire and
                # is never read into memory, and clients rely on nothing following it
                wire.send_all(sock, [*pending, RESP.pack(status, req_id, 0)])
                raise _Closing
            if region.view.mv is None:
                return flags, self._device(sock, peer, op, req_id, region, offset, length, pending)
            view = region.view.mv[offset : offset + length]
            if op == _WRITE:
                got = sock.recv_into(view, length, socket.MSG_WAITALL)
                if got != length:  # rare: a signal, or EOF (0)
                    if got == 0:
                        raise ConnectionError("peer closed the connection mid-write")
                    wire.recv_exact(sock, view[got:])
                pending.append(RESP.pack(_OK, req_id, 0))
            else:
                pending += (RESP.pack(_OK, req_id, length), view)
                added = length
        elif op in self.handlers:
            if length > wire.MAX_CONTROL_BYTES:
                self._malformed(peer, f"control payload {length} > {wire.MAX_CONTROL_BYTES}")
            payload = bytearray(length)
            got = sock.recv_into(payload, length, socket.MSG_WAITALL) if length else 0
            if got != length:  # rare: a signal, or EOF (0)
                if got == 0:
                    raise ConnectionError("peer closed the connection mid-request")
                wire.recv_exact(sock, memoryview(payload)[got:])
            status, reply = self._control(op, bytes(payload), peer)
            pending += (RESP.pack(status, req_id, len(reply)), reply)
        else:
            self._malformed(peer, f"unknown op {op}")
        return flags, added

    def _device(
        self,
        sock: socket.socket,
        peer: str,
        op: int,
        req_id: int,
        region: Region,
        offset: int,
        length: int,
        pending: list[bytes | memoryview],
    ) -> int:
        """Serve a READ or WRITE of device memory through the stager's host buffers (the
        replies queued so far go first); returns bytes of READ data queued (none)."""
        assert self._stager is not None

        def send(chunk: np.ndarray, pos: int) -> Callable[[], None]:
            wire.send_all(sock, [chunk.data])
            return _done

        def recv(chunk: np.ndarray, pos: int) -> Callable[[], None]:
            wire.recv_exact(sock, chunk.data)
            return _done

        try:
            if op == _READ:
                wire.send_all(sock, [*pending, RESP.pack(_OK, req_id, length)])
                pending.clear()
                self._stager.out(region.view, offset, length, send)
            else:
                self._stager.into(region.view, offset, length, recv)
                pending.append(RESP.pack(_OK, req_id, 0))
        except OSError:
            raise
        except Exception:  # a CUDA error: the stream of bytes is broken, close the connection
            log.exception(
                "transfer server: %s of device segment %r for %s failed",
                Op(op).name,
                region.name,
                peer,
            )
            raise _Closing from None
        return 0

    def _access(self, token: int, offset: int, length: int) -> tuple[Status, Region | None]:
        """The region a READ/WRITE may touch, or (why not, None)."""
        region = self.segments.by_token(token)
        if region is None:
            return Status.NO_SEGMENT, None
        if region.view.mv is None and self._stager is None:
            return Status.BAD_REQUEST, None  # device memory, and no staging to reach it
        if region.bounds_error(offset, length):
            return Status.OUT_OF_BOUNDS, None
        return Status.OK, region

    def _recv_header(self, sock: socket.socket, hdr: bytearray) -> bool:
        n = sock.recv_into(hdr, REQ.size, socket.MSG_WAITALL)
        if n == 0:
            return False  # clean close between requests
        if n < REQ.size:
            wire.recv_exact(sock, memoryview(hdr)[n:])
        return True

    def _control(self, op: int, payload: bytes, peer: str) -> tuple[Status, bytes]:
        try:
            return self.handlers[op](payload)  # type: ignore[index]
        except MooncakeError as e:
            log.warning("transfer server: %s from %s refused: %s", Op(op).name, peer, e)
            return Status.BAD_REQUEST, str(e).encode()[:4096]
        except Exception:
            log.exception("transfer server: %s from %s failed", Op(op).name, peer)
            return Status.INTERNAL, b""

    @staticmethod
    def _malformed(peer: str, why: str) -> None:
        log.error(
            "transfer server: malformed request from %s (%s); closing that connection", peer, why
        )
        raise _Closing

    def drop_connections(self) -> int:
        """Close every client connection (clients reconnect on next use); returns how many."""
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(conns)

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        self._thread.join(timeout=2.0)
