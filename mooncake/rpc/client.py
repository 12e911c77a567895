"""RpcClient: blocking calls and events to one server; thread-safe (a connection per thread)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec
import zmq

import mooncake.rpc.wire as wire
from mooncake.errors import AuthError, RpcError, RpcTimeout
from mooncake.rpc.auth import HandshakeWatch, check_secret, secure_client
from mooncake.rpc.wire import M, Msg

log = logging.getLogger(__name__)

# Plain ints: the enum versions cost microseconds per operation on the hot path.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
DEFAULT_SPIN_US = 0.0  # microseconds call() busy-waits before sleeping (see RpcClient)


def dealer_socket(
    ctx: zmq.Context[Any], address: str, secret: bytes | None, max_frame_bytes: int
) -> zmq.Socket[Any]:
    """A connected DEALER for `address`, set up the way every client of ours needs it.
    Several addresses, comma-separated, are all dialed: calls go to those that listen (the
    masters on etcd: the leader alone listens, see docs/ha.md)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0  # close() never waits for unsent requests
    sock.immediate = True  # NOTE: no queueing while disconnected: calls in an outage time out
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    secure_client(sock, secret)
    try:
        for one in address.split(","):
            sock.connect(one)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise RpcError(f"cannot connect to {address!r}: {e} (expected tcp://host:port)") from e
    return sock


def auth_refused(address: str, tag: str) -> AuthError:
    return AuthError(
        f"{address} refused the CURVE handshake for {tag}: it does not share this node's "
        "cluster secret (check the `secret` of both configs)"
    )


def timeout_error(
    watch: HandshakeWatch | None, address: str, tag: str, timeout_s: float, sent: bool
) -> RpcError:
    """AuthError if the server refused our handshake, else RpcTimeout saying what was waited for."""
    if watch is not None and watch.poll():
        return auth_refused(address, tag)
    if not sent:
        return RpcTimeout(
            f"no connection to {address} within {timeout_s:g} s to send {tag} "
            "(server down or unreachable?)"
        )
    return RpcTimeout(f"no reply from {address} to {tag} within {timeout_s:g} s")


class _Conn:
    """One thread's DEALER socket and the state only that thread touches."""

    def __init__(self, client: RpcClient):
        self.sock = dealer_socket(
            zmq.Context.instance(), client.address, client.secret, client.max_frame_bytes
        )
        self.watch = HandshakeWatch(self.sock) if client.secret is not None else None
        self.encoder = msgspec.msgpack.Encoder()
        self.req_id = 0  # last request id sent on this socket
        self.rcvtimeo = -2  # ms; cached to skip setsockopt when unchanged

    def send(self, frame: bytes, deadline: float) -> bool:
        """Send `frame` by `deadline` (time.monotonic); False if there was no connection.

        Raises AuthError as soon as the server refuses our handshake, without waiting.
        """
        try:
            self.sock.send(frame, _NOBLOCK)  # the hot path: connected, nothing queued
            return True
        except zmq.Again:
            pass
        poller = zmq.Poller()  # not connected yet, or a server outage: wait for either
        poller.register(self.sock, zmq.POLLOUT)
        if self.watch is not None:
            poller.register(self.watch.pair, zmq.POLLIN)
        while (remaining_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            poller.poll(remaining_ms)
            if self.watch is not None and self.watch.poll():
                return False  # the caller raises AuthError
            try:
                self.sock.send(frame, _NOBLOCK)
                return True
            except zmq.Again:
                continue
        return False

    def set_rcvtimeo(self, ms: int) -> None:
        if self.rcvtimeo != ms:
            self.sock.rcvtimeo = self.rcvtimeo = ms

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sock.close(linger=0)


class RpcClient:
    """Calls one server. Thread-safe: each calling thread lazily gets its own connection.

    Prefer one long-lived client per server shared by the threads of a process: a thread's
    connection lives until close(), which must run when no call is in flight. Reconnects by
    itself when the server restarts.
    """

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        *,
        timeout_s: float = 5.0,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        spin_us: float = DEFAULT_SPIN_US,
    ):
        """`secret=None` disables authentication and encryption (benchmarks, tests only).

        `spin_us`: how long call() busy-waits for the reply before sleeping in the kernel.
        On an idle machine spinning skips one thread wake-up per call (about -30% latency);
        on a busy one it steals CPU from the threads that carry the reply and makes p50 and
        p90 worse (measured with `mooncake bench rpc --spin-us`), hence off by default.
        """
        if secret is not None:
            check_secret(secret)
        self.address = address
        self.secret = secret
        self.timeout_s = timeout_s  # default for call() and send_event()
        self.max_frame_bytes = max_frame_bytes
        self.spin_ns = int(spin_us * 1000)
        self._local = threading.local()
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()  # guards _conns only (taken once per thread)
        self._closed = False

    def call(self, msg: Msg, reply_type: type[M], *, timeout_s: float | None = None) -> M:
        """Send `msg`, wait for its reply of `reply_type` and return it.

        Raises RpcTimeout (no connection or no reply in time), AuthError (the server refused
        our key), RemoteError (the handler raised; `remote_type` names the exception) or
        ProtocolError (the request or the reply was malformed).
        """
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        info = wire.msg_type(reply_type)
        conn.req_id += 1
        req_id = conn.req_id
        frame = wire.encode_frame(conn.encoder, wire.KIND_REQUEST, req_id, msg)
        deadline = time.monotonic() + timeout_s
        if not conn.send(frame, deadline):
            raise self._timeout(conn, msg, timeout_s, sent=False)
        sock = conn.sock
        if self.spin_ns:
            end_ns = time.perf_counter_ns() + self.spin_ns
            events = sock.getsockopt
            while not events(_EVENTS) & _POLLIN and time.perf_counter_ns() < end_ns:  # type: ignore[operator]
                pass
        conn.set_rcvtimeo(max(1, int(timeout_s * 1000)))
        while True:
            try:
                data = sock.recv()
            except zmq.Again:
                raise self._timeout(conn, msg, timeout_s, sent=True) from None
            kind, got_id, tag, offset = wire.parse_head(data, self.max_frame_bytes)
            if got_id == req_id:
                return wire.unpack_reply(info, data, kind, tag, offset, msg, self.address)
            # A reply to an earlier call that timed out: drop it, keep waiting for ours.
            log.debug("dropped a late reply (id %d) from %s", got_id, self.address)
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise self._timeout(conn, msg, timeout_s, sent=True)
            conn.set_rcvtimeo(remaining_ms)

    def send_event(self, msg: Msg, *, timeout_s: float | None = None) -> None:
        """Queue the one-way event `msg` (no reply, no delivery guarantee).

        Raises RpcTimeout if there is no connection to the server within the timeout, and
        AuthError if the server refuses our key.
        """
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        frame = wire.encode_frame(conn.encoder, wire.KIND_EVENT, 0, msg)
        if not conn.send(frame, time.monotonic() + timeout_s):
            raise self._timeout(conn, msg, timeout_s, sent=False)

    def close(self) -> None:
        """Close every thread's connection; call only when no call is in flight."""
        with self._lock:
            self._closed = True
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> _Conn:
        with self._lock:
            if self._closed:
                raise RpcError(f"the client of {self.address} is closed")
            conn = _Conn(self)
            self._conns.append(conn)
        self._local.conn = conn
        return conn

    def _timeout(self, conn: _Conn, msg: Msg, timeout_s: float, *, sent: bool) -> RpcError:
        tag = wire.msg_type(type(msg)).tag
        return timeout_error(conn.watch, self.address, tag, timeout_s, sent)
