"""The Store's direct control channel: `store.*` calls without ZeroMQ's thread hops.

A ZeroMQ call wakes six threads in turn (caller, its I/O thread, the master's I/O thread,
the handler thread, and back); on a 2-core VM each wake-up costs tens of microseconds, so
a call takes 150-250 us where the handler needs 5-25. Here the caller's own thread sends
the request frame on its own connection and a thread of the master's `TcpServer` answers
it with the same handlers (`RpcServer.answer`, under the service lock): two wake-ups, or
one when the reply comes within the caller's polling spin (`[transfer] spin_us`).

    server = DirectServer(rpc_server, secret, host)     # in StoreService; port -> clients
    channel = DirectChannel(host, server.port, secret, timeout_s=10.0)
    reply = channel.call(PutStartMsg(...), PutStartReplyMsg)

Security is the data plane's: a connection is served only after the HMAC challenge on the
cluster secret that both ends pass (`transfer.wire`); the frames then travel in clear, as
the KV bytes and the DESCRIBE/RDMA_CONNECT control messages of the data plane do. Frames
use the RPC codec (typed, size-limited, never unpickled). Everything else, and every call
when the master offers no direct port, stays on the CURVE-encrypted RPC.
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import threading
import time
from typing import Any

import msgspec

from mooncake.config.portrange import PortRange
from mooncake.errors import MooncakeError, ProtocolError, RpcError, RpcTimeout
from mooncake.rpc import wire as rpc_wire
from mooncake.rpc.client import RpcClient
from mooncake.rpc.server import Peer, RpcServer
from mooncake.rpc.wire import M, Msg, RemoteProtocolError
from mooncake.store.server.messages import DirectPortMsg, DirectPortReplyMsg
from mooncake.transfer import admission, wire
from mooncake.transfer.segment import SegmentTable
from mooncake.transfer.server import TcpServer
from mooncake.transfer.wire import FLAG_FLUSH, REQ, RESP, Op, Status

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = wire.MAX_CONTROL_BYTES  # larger requests go over the RPC
CONNECT_TIMEOUT_S = 2.0  # a firewalled port costs this once per RETRY_DIRECT_S
RETRY_DIRECT_S = 30.0  # after a failed connect, the RPC carries every call this long
# a thread's connection: socket, request ids, encoder, receive buffer, EOF poller
_Conn = tuple[socket.socket, Any, msgspec.msgpack.Encoder, bytearray, select.poll]
_CALL, _OK = int(Op.CALL), int(Status.OK)
_BUF_BYTES = 64 << 10  # receive buffer of a connection: a reply this small takes one recv


class DirectServer:
    """Answers the request frames of `rpc`'s handlers on a TcpServer bound to `host`."""

    def __init__(
        self,
        rpc: RpcServer,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int | PortRange = 0,
        *,
        handshake_timeout_s: float = wire.HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = admission.MAX_PENDING_HANDSHAKES,
    ):
        """`handshake_timeout_s`, `max_pending_handshakes`: [transfer]'s, as TcpServer's."""
        self._rpc = rpc
        self._local = threading.local()  # a msgpack encoder per connection thread
        self._tcp = TcpServer(
            SegmentTable(native=False),
            secret,
            host,
            port,
            handshake_timeout_s=handshake_timeout_s,
            max_pending_handshakes=max_pending_handshakes,
        )
        self._tcp.handlers[Op.CALL] = self._answer
        self.port: int = self._tcp.port

    def _answer(self, payload: bytes) -> tuple[Status, bytes]:
        encoder = getattr(self._local, "encoder", None)
        if encoder is None:
            encoder = self._local.encoder = msgspec.msgpack.Encoder()
        out = self._rpc.answer(payload, _PEER, encoder)
        return Status.OK, out or b""  # NOTE: events get an empty reply: nobody reads it

    def close(self) -> None:
        self._tcp.close()


_PEER = Peer(b"", "direct")


class DirectUnavailable(RpcError):
    """The direct channel could not connect; nothing was sent (use the RPC instead)."""


class DirectTooLarge(DirectUnavailable):
    """The request is larger than the channel takes; nothing was sent (use the RPC)."""


class DirectChannel:
    """Calls over the master's DirectServer: one connection per calling thread."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        *,
        timeout_s: float,
        connect_timeout_s: float = 0.0,  # 0 = timeout_s
        max_reply_bytes: int = 64 << 20,
        spin_s: float = 0.0,
    ):
        """`spin_s`: seconds a call polls for its reply before sleeping (wire.recv_some)."""
        self.address = f"{host}:{port}"
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.spin_s = spin_s
        self._secret = secret
        self._local = threading.local()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def call(self, msg: Msg, reply_type: type[M]) -> M:
        """Send `msg`, return its reply. Raises DirectUnavailable if no connection could be
        made (nothing sent), RpcTimeout or RpcError if the call failed after it was sent,
        RemoteError if the handler refused it, as RpcClient.call does."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn[4].poll(0):  # closed by the master while idle (a
            self._drop(conn[0])  # restart): reconnect, as nothing was sent on it
            conn = None
        if conn is None:
            conn = self._connect()
        sock, ids, encoder, buf, _ = conn
        req_id = next(ids) & 0xFFFFFFFF
        frame = rpc_wire.encode_frame(encoder, rpc_wire.KIND_REQUEST, req_id, msg)
        if len(frame) > MAX_REQUEST_BYTES:
            raise DirectTooLarge(f"a {len(frame)}-byte request is too large for it")
        try:
            wire.send_all(sock, (REQ.pack(_CALL, FLAG_FLUSH, 0, req_id, 0, 0, len(frame)), frame))
            got = wire.recv_some(sock, buf, self.spin_s)  # NOTE: a small reply arrives whole
            if got < RESP.size:
                wire.recv_exact(sock, memoryview(buf)[got : RESP.size])
                got = RESP.size
            status, got_id, length = RESP.unpack_from(buf)
            if got_id != req_id or status != _OK or length > self.max_reply_bytes:
                raise ProtocolError(
                    f"reply {got_id} to call {req_id}: status {status} "
                    f"({wire.status_text(status)}), {length} bytes"
                )
            end = RESP.size + length
            if end <= len(buf):
                if got < end:
                    wire.recv_exact(sock, memoryview(buf)[got:end])
                data = memoryview(buf)[RESP.size : end]  # NOTE: decoding copies what it keeps
            else:  # a large reply (a big batch)
                data = memoryview(bytearray(length))
                data[: got - RESP.size] = buf[RESP.size : got]
                wire.recv_exact(sock, data[got - RESP.size :])
        except (OSError, ProtocolError) as e:
            self._drop(sock)
            what = rpc_wire.msg_type(type(msg)).tag
            if isinstance(e, BlockingIOError | TimeoutError):
                raise RpcTimeout(
                    f"no reply from {self.address} to {what} within {self.timeout_s:g} s"
                ) from e
            raise RpcError(f"direct call {what} to {self.address} failed: {e}") from e
        kind, got_id, tag, offset = rpc_wire.parse_head(data, self.max_reply_bytes)
        info = rpc_wire.msg_type(reply_type)
        return rpc_wire.unpack_reply(info, data, kind, tag, offset, msg, self.address)

    def _connect(self) -> _Conn:
        with self._lock:
            if self._closed:
                raise DirectUnavailable(f"the direct channel to {self.address} is closed")
        try:
            sock = wire.connect(self.host, self.port, self._secret, self.connect_timeout_s)
            wire.tune(sock, self.timeout_s)  # calls may wait for the master that long
        except (OSError, MooncakeError) as e:
            raise DirectUnavailable(f"no direct connection to {self.address}: {e}") from e
        with self._lock:
            self._socks.add(sock)
        idle = select.poll()  # readable between calls = the master closed the connection
        idle.register(sock, select.POLLIN | select.POLLRDHUP)
        conn = (sock, itertools.count(1), msgspec.msgpack.Encoder(), bytearray(_BUF_BYTES), idle)
        self._local.conn = conn
        return conn

    def _drop(self, sock: socket.socket) -> None:
        self._local.conn = None
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def close(self) -> None:
        """Close every thread's connection; call only when no call is in flight."""
        with self._lock:
            self._closed = True
            socks, self._socks = list(self._socks), set()
        for sock in socks:
            sock.close()


class MasterCalls:
    """A Store client's calls to its master: on the direct channel when the master offers
    one (asked once over the RPC; asked again when the channel stops connecting, e.g. the
    master restarted on another port), over the RPC otherwise and for oversized requests.
    Raises what RpcClient.call raises."""

    def __init__(
        self, rpc: RpcClient, timeout_s: float, use_direct: bool = True, spin_s: float = 0.0
    ):
        self.rpc, self.timeout_s, self.spin_s = rpc, timeout_s, spin_s
        self.direct: DirectChannel | None = None
        self._known = not use_direct  # True once we know whether the master offers one
        self._ask_after = 0.0  # time.monotonic() before which the RPC carries every call
        self._failed_port = 0  # the port that just failed to connect
        self._lock = threading.Lock()
        self._retired: list[DirectChannel] = []  # NOTE: other threads may still use them

    def call(self, msg: Msg, reply_type: type[M]) -> M:
        direct = self.direct if self._known else self._find()
        if direct is not None:
            try:
                return direct.call(msg, reply_type)
            except DirectTooLarge:  # nothing was sent: the RPC carries this one
                pass
            except DirectUnavailable as e:  # nothing was sent; the master may have moved
                with self._lock:
                    if self.direct is direct:
                        log.info("store: %s; asking the master for its port again", e)
                        self._retired.append(direct)
                        self.direct, self._known, self._failed_port = None, False, direct.port
        return self.rpc.call(msg, reply_type)

    def _find(self) -> DirectChannel | None:
        with self._lock:
            if not self._known and time.monotonic() >= self._ask_after:
                try:
                    reply = self.rpc.call(DirectPortMsg(), DirectPortReplyMsg)
                    port, host = reply.port, reply.host
                except RemoteProtocolError:  # an older master: no such message
                    port, host = 0, ""
                if port and port == self._failed_port:  # offered again, still unreachable
                    log.warning(
                        "store: the master's direct port %d does not connect (a "
                        "firewall?); RPC only for %g s",
                        port,
                        RETRY_DIRECT_S,
                    )
                    self._ask_after, self._failed_port = time.monotonic() + RETRY_DIRECT_S, 0
                    return None
                if port and self.rpc.secret is not None:
                    # NOTE: the master's own host: the RPC may dial several masters
                    host = host or self.rpc.address.removeprefix("tcp://").rpartition(":")[0]
                    self.direct = DirectChannel(
                        host.strip("[]"),
                        port,
                        self.rpc.secret,
                        timeout_s=self.timeout_s,
                        connect_timeout_s=CONNECT_TIMEOUT_S,
                        spin_s=self.spin_s,
                    )
                self._known = True
            return self.direct

    def close(self) -> None:
        for direct in [*self._retired, self.direct]:
            if direct is not None:
                direct.close()
