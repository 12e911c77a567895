"""RpcServer: a ROUTER socket served by one thread that calls the registered handlers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import zmq

import mooncake.rpc.wire as wire
from mooncake.config.portrange import PortRange, bind_zmq
from mooncake.errors import MooncakeError, PortInUseError, ProtocolError, RpcError
from mooncake.rpc.auth import ZapHandler, check_secret, secure_server
from mooncake.rpc.wire import M, Msg, MsgType

log = logging.getLogger(__name__)

_RCVMORE, _SNDMORE = int(zmq.RCVMORE), int(zmq.SNDMORE)  # plain ints: enums are slower
_MAX_PEERS = 4096  # connections whose address the server remembers
_LOG_EVERY_S = 10.0  # seconds between two warnings about bad frames (the rest are counted)


class Peer(NamedTuple):
    """The sender of a message."""

    routing_id: bytes  # ZeroMQ's id of the connection, unique among this server's peers
    address: str  # the peer's IP address as the server saw it

    def __str__(self) -> str:
        return f"{self.address}#{self.routing_id.hex()}"


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:  # no address metadata (e.g. inproc)
        return "?"


Handler = Callable[[Any, Peer], Msg]  # (request, peer) -> reply; raise MooncakeError to refuse
EventHandler = Callable[[Any, Peer], None]


class RpcServer:
    """Serves requests and events for the registered message types on one address.

    Handlers run one at a time on the server's thread, so a handler never races another one
    of the same server, and a slow handler delays every caller: hand long work elsewhere.
    """

    def __init__(
        self,
        bind: str,
        secret: bytes | None,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        name: str = "rpc",
        ports: PortRange | None = None,
    ):
        """`secret=None` disables authentication and encryption (benchmarks, tests only).
        With `ports`, a `bind` ending in ":0" takes the first free port of that range."""
        if secret is not None:
            check_secret(secret)
        self.bind = bind
        self.ports = ports or PortRange()
        self.name = name  # used in log lines and the thread name
        self.max_frame_bytes = max_frame_bytes
        self._secret = secret
        self._requests: dict[bytes, tuple[MsgType[Any], Handler]] = {}
        self._events: dict[bytes, tuple[MsgType[Any], EventHandler]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._thread: threading.Thread | None = None
        self._address = ""
        self._next_warning = 0.0  # monotonic seconds
        self._num_suppressed = 0

    def register(self, msg_type: type[M], handler: Callable[[M, Peer], Msg]) -> None:
        """Answer requests of `msg_type` with `handler(msg, peer)`; may be called while running."""
        info = wire.msg_type(msg_type)
        assert info.tag_bytes not in self._requests, f"{info.tag} already has a handler"
        self._requests[info.tag_bytes] = (info, handler)

    def on_event(self, msg_type: type[M], fn: Callable[[M, Peer], None]) -> None:
        """Call `fn(msg, peer)` for each one-way event of `msg_type`."""
        info = wire.msg_type(msg_type)
        assert info.tag_bytes not in self._events, f"{info.tag} already has an event handler"
        self._events[info.tag_bytes] = (info, fn)

    @property
    def address(self) -> str:
        """The bound endpoint with its real port, e.g. "tcp://127.0.0.1:41873"."""
        assert self._address, "call start() first"
        return self._address

    def start(self) -> None:
        """Bind and start serving on a background thread; raises RpcError if binding fails."""
        assert self._thread is None, "already started"
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        secure_server(self._sock, self._secret)
        try:
            self._bind()
        except (zmq.ZMQError, MooncakeError) as e:
            self._sock.close(linger=0)
            self._ctx.term()
            in_use = isinstance(e, zmq.ZMQError) and e.errno == zmq.EADDRINUSE
            error = PortInUseError if in_use else RpcError
            raise error(f"{self.name}: cannot bind {self.bind}: {e}") from e
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._threads = [
            threading.Thread(target=self._run, name=f"{self.name}-server", daemon=True)
        ]
        if self._secret is not None:
            zap = ZapHandler(self._ctx, self._secret)
            self._threads.append(
                threading.Thread(target=zap.run, name=f"{self.name}-zap", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        self._thread = self._threads[0]
        log.info("%s: serving on %s (auth %s)", self.name, self._address, self._auth_name)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the address; idempotent. Waits for a running handler."""
        if self._thread is None:
            return
        assert threading.current_thread() is not self._thread, "stop() from a handler deadlocks"
        # NOTE: term() makes the blocked recv() of each thread raise ContextTerminated; each
        # thread then closes its own socket, which lets term() return.
        self._ctx.term()
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), f"{self.name}: {thread.name} did not stop"
        self._thread = None
        log.info("%s: stopped serving on %s", self.name, self._address)

    def __enter__(self) -> RpcServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _auth_name(self) -> str:
        return "CURVE" if self._secret is not None else "DISABLED"

    def _bind(self) -> None:
        bind_zmq(self._sock, self.bind, self.ports)

    def _run(self) -> None:
        """The serving loop: blocking receives (no poll) keep the round trip short."""
        sock, more = self._sock, _RCVMORE
        addresses: dict[bytes, str] = {}  # routing id -> peer address, read once per connection
        try:
            while True:
                routing_id = sock.recv()
                if not sock.getsockopt(more):
                    continue  # nothing after the routing id: nothing to answer
                address = addresses.get(routing_id)
                if address is None:  # a new connection: read its address from the metadata
                    frame = sock.recv(copy=False)
                    address = _peer_address(frame)
                    data: bytes | None = frame.bytes
                    if len(addresses) >= _MAX_PEERS:
                        addresses.clear()  # forget closed connections; live ones re-enter
                    addresses[routing_id] = address
                else:
                    data = sock.recv()
                while sock.getsockopt(more):  # extra parts: not our protocol
                    sock.recv()
                    data = None
                try:
                    self._serve(Peer(routing_id, address), data)
                except zmq.ContextTerminated:
                    raise
                except Exception:  # a bug of ours; keep serving the other peers
                    log.exception("%s: failed to serve a frame", self.name)
        except zmq.ContextTerminated:
            pass  # stop() was called
        finally:
            sock.close(linger=0)

    def _serve(self, peer: Peer, data: bytes | None) -> None:
        """Handle one frame from `peer`; never raises (a peer must not stop the server)."""
        out = self.answer(data, peer, self._encoder)
        if out is not None:
            self._sock.send(peer.routing_id, _SNDMORE)
            self._sock.send(out)

    def answer(
        self, data: bytes | None, peer: Peer, encoder: msgspec.msgpack.Encoder
    ) -> bytes | None:
        """Decode one request or event frame, run its handler, and return the reply frame
        (an error frame if the request was bad or its handler raised; None for an event).
        Never raises. The server's own loop calls it; another transport may too (the Store's
        direct channel), from its own thread with that thread's `encoder`: the handlers
        must then guard their state themselves (the Store's take the service lock)."""
        kind, req_id = wire.KIND_REQUEST, 0
        try:
            if data is None:
                raise ProtocolError("multipart message; the protocol sends exactly one frame")
            kind, req_id, tag, offset = wire.parse_head(data, self.max_frame_bytes)
            if kind == wire.KIND_REQUEST:
                entry = self._requests.get(tag)
            elif kind == wire.KIND_EVENT:
                entry = self._events.get(tag)  # type: ignore[assignment]
            else:
                raise ProtocolError(f"a server accepts requests and events, not {kind=}")
            if entry is None:
                raise ProtocolError(
                    f"no handler for {wire.KIND_NAMES[kind]} {wire.show_tag(tag)} on {self.name}"
                )
            info, handler = entry
            msg = wire.decode_body(info, data, offset)
        except ProtocolError as e:
            self._warn_bad_frame(peer, e)
            if kind == wire.KIND_EVENT:  # nobody waits for an answer
                return None
            return self._error_frame(encoder, req_id, wire.CODE_PROTOCOL, str(e), "ProtocolError")
        try:
            reply = handler(msg, peer)
            if kind == wire.KIND_EVENT:
                return None
            if not isinstance(reply, Msg):
                raise TypeError(f"handler returned {type(reply).__name__}, not a Msg")
            return wire.encode_frame(encoder, wire.KIND_REPLY, req_id, reply)
        except MooncakeError as e:
            log.info("%s: %s from %s failed: %s", self.name, info.tag, peer, e)
            if kind != wire.KIND_REQUEST:
                return None
            return self._error_frame(encoder, req_id, wire.CODE_ERROR, str(e), type(e).__name__)
        except Exception as e:
            log.exception("%s: handler for %s from %s crashed", self.name, info.tag, peer)
            if kind != wire.KIND_REQUEST:
                return None
            text = f"internal error in the {info.tag} handler: {type(e).__name__}: {e}"
            return self._error_frame(encoder, req_id, wire.CODE_INTERNAL, text, type(e).__name__)

    @staticmethod
    def _error_frame(
        encoder: msgspec.msgpack.Encoder, req_id: int, code: str, text: str, rtype: str
    ) -> bytes:
        err = wire.ErrorMsg(code=code, message=text, remote_type=rtype)
        return wire.encode_frame(encoder, wire.KIND_ERROR, req_id, err)

    def _warn_bad_frame(self, peer: Peer, e: ProtocolError) -> None:
        """Log a bad frame, at most one warning per _LOG_EVERY_S (an authenticated peer's bug)."""
        now = time.monotonic()
        if now < self._next_warning:
            self._num_suppressed += 1
            log.debug("%s: bad frame from %s: %s", self.name, peer, e)
            return
        more = (
            f" ({self._num_suppressed} more since the last warning)" if self._num_suppressed else ""
        )
        log.warning("%s: bad frame from %s: %s%s", self.name, peer, e, more)
        self._next_warning, self._num_suppressed = now + _LOG_EVERY_S, 0
