"""The TCP data-plane protocol: fixed-size headers (never pickled), the HMAC handshake every
connection passes before it may touch memory, and exact send/receive of buffer lists.

Connection setup (one HMAC per connection, none per slice):

    server -> client  HELLO  magic "MCTE", version, server nonce (32 B)
    client -> server  AUTH   magic, version, client nonce (32 B), HMAC(secret, "c"|sn|cn)
    server -> client  PROOF  HMAC(secret, "s"|cn|sn)     (the client checks the server too)

A server gives a new connection `[transfer] handshake_timeout_s` for the whole exchange
(not per read: a peer trickling bytes is cut off at the deadline), and at most
`[transfer] max_pending_handshakes` connections may be in it at once; a new one then
pushes out the oldest of the address holding the most (`admission.PendingHandshakes`), so
unauthenticated peers can neither pile up threads nor keep real peers out.

Then requests, each answered in order on the same connection:

    REQ   op u8 | flags u8 | pad u16 | req_id u32 | token u64 | offset u64 | length u64
          WRITE: followed by `length` payload bytes; READ: nothing;
          DESCRIBE/RDMA_CONNECT/CALL/DESCRIBE_ADDRESS/NOTIFY: followed by a msgpack
          payload of `length` bytes
    RESP  status u8 | pad 3 | req_id u32 | length u64, then `length` bytes (READ data or a
          msgpack reply); an error status carries no data, and the server then closes the
          connection (a rejected WRITE's payload is never read into memory)

A client may send many requests before reading replies; replies come in request order.
The server sends its queued replies when a request carries FLAG_FLUSH (the client marks
the last request before it waits), or, for requests without it, once nothing more has
arrived (one extra receive attempt per reply batch).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from mooncake.errors import AuthError, ConfigError, ProtocolError

MAGIC: Final = b"MCTE"
VERSION: Final = 1
NONCE_BYTES: Final = 32
HELLO = struct.Struct("!4sHH32s")
AUTH = struct.Struct("!4sHH32s32s")
PROOF_BYTES: Final = 32
REQ = struct.Struct("!BBHIQQQ")
RESP = struct.Struct("!BxxxIQ")
FLAG_FLUSH: Final = 1  # REQ flags: the client waits now; reply without waiting for more
MAX_DATA_BYTES: Final = 1 << 30  # one slice; a larger length is malformed
MAX_CONTROL_BYTES: Final = 1 << 20  # one msgpack control message
SOCKET_BUFFER_BYTES: Final = 4 << 20
MIN_SECRET_BYTES: Final = 16  # as the control plane's rule
HANDSHAKE_TIMEOUT_S: Final = 5.0  # default of [transfer] handshake_timeout_s


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2
    DESCRIBE = 3  # payload: segment name (utf-8); reply: msgpack SegmentDesc
    RDMA_CONNECT = 4  # payload/reply: msgpack RdmaConnectMsg
    CALL = 5  # payload/reply: a control-plane frame (mooncake.rpc.wire), e.g. store.* calls
    DESCRIBE_ADDRESS = 6  # payload: msgpack AddressQuery; reply: msgpack BufferDesc
    NOTIFY = 7  # payload: msgpack [name, message]; reply: empty (upstream's TransferNotify)


class Status(enum.IntEnum):
    OK = 0
    NO_SEGMENT = 1  # unknown name or token (unregistered or re-registered)
    OUT_OF_BOUNDS = 2
    BAD_REQUEST = 3  # well-formed header the server cannot serve (e.g. rdma not enabled)
    INTERNAL = 4


STATUS_TEXT: Final = {
    Status.NO_SEGMENT: "the peer has no such segment (unregistered or re-registered)",
    Status.OUT_OF_BOUNDS: "the peer rejected the range as outside the segment",
    Status.BAD_REQUEST: "the peer cannot serve this request",
    Status.INTERNAL: "the peer failed internally (see its log)",
}


def check_secret(secret: bytes) -> None:
    """Raise ConfigError unless `secret` is long enough to resist guessing from a handshake."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"cluster secret: need at least {MIN_SECRET_BYTES} bytes, got {len(secret)}; "
            "generate one with `openssl rand -hex 32`"
        )


def status_text(code: int) -> str:
    """What a non-OK reply status means, in words."""
    known = Status._value2member_map_.get(code)
    return STATUS_TEXT.get(known, f"unknown status {code}") if known else f"unknown status {code}"  # type: ignore[call-overload]


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def recv_some(sock: socket.socket, buf: bytearray | memoryview, spin_s: float = 0.0) -> int:
    """One recv_into `buf` (up to its length); returns the bytes received, 0 at EOF.

    `spin_s` > 0: poll without sleeping for up to `spin_s` seconds first. A reply that
    comes within the spin costs the caller no wake-up: on a VM, waking a sleeping thread
    (and its idle virtual CPU) adds tens of microseconds to a round trip that is itself
    tens of microseconds (busy polling, as RDMA completion queues are polled). Then, or
    without a spin, a blocking receive (the socket's SO_RCVTIMEO applies)."""
    if spin_s > 0:
        n: int | None = _polled(spin_s, sock.recv_into, buf, 0, socket.MSG_DONTWAIT)
        if n is not None:
            return n
    return sock.recv_into(buf)


def _polled(spin_s: float, receive: Callable[..., Any], *args: Any) -> Any:
    """`receive(*args)` (a MSG_DONTWAIT receive) retried until it returns, for up to
    `spin_s` seconds; None if nothing came by then."""
    until = time.perf_counter() + spin_s
    while True:
        try:
            return receive(*args)
        except BlockingIOError:
            if time.perf_counter() > until:
                return None


def recv_exact(sock: socket.socket, buf: memoryview | bytearray) -> None:
    """Fill `buf` from `sock`; raises ConnectionError on EOF (blocking sockets only)."""
    view = memoryview(buf)
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_until_eof(sock: socket.socket, bufs: list[memoryview], spin_s: float = 0.0) -> int:
    """Scatter up to sum(len(b)) bytes from `sock` into `bufs` (recvmsg_into with
    MSG_WAITALL: usually one syscall); returns the bytes received, fewer only if the peer
    closed the connection first. Raises OSError on errors and timeouts.

    `spin_s` > 0: first poll without sleeping for as long as bytes keep coming within
    `spin_s` of each other (see `recv_some`), then sleep in the kernel for the rest."""
    total = sum(map(len, bufs))
    got = 0
    while spin_s > 0:
        got_msg = _polled(spin_s, sock.recvmsg_into, bufs[:1024], 0, socket.MSG_DONTWAIT)
        if got_msg is None:
            break
        n = got_msg[0]
        got += n
        if n == 0 or got >= total:
            return got
        bufs = _advance(bufs, n)
    while True:
        n = sock.recvmsg_into(bufs[:1024], 0, socket.MSG_WAITALL)[0]  # IOV_MAX
        got += n
        if n == 0 or got >= total:
            return got
        bufs = _advance(bufs, n)


def send_all(sock: socket.socket, bufs: Sequence[bytes | memoryview]) -> None:
    """Send every buffer of `bufs` in order with sendmsg, resuming after partial sends."""
    pending = bufs
    while pending:
        batch = pending[:1024] if len(pending) > 1024 else pending  # IOV_MAX
        n = sock.sendmsg(batch)
        if batch is pending and n == sum(map(len, batch)):
            return
        pending = _advance(pending, n)


def send_request(
    sock: socket.socket, op: int, mem: memoryview, token: int, remote_offset: int, rid: int
) -> None:
    """One READ or WRITE request `rid` of len(mem) bytes (a WRITE carries `mem`), flagged
    for a reply at once."""
    hdr = REQ.pack(op, FLAG_FLUSH, 0, rid, token, remote_offset, len(mem))
    send_all(sock, (hdr,) if op == Op.READ else (hdr, mem))


def recv_reply(sock: socket.socket, op: int, mem: memoryview, rid: int, spin_s: float) -> int:
    """The reply to send_request()'s `rid` (a READ's data lands in `mem`); returns its
    status. Raises OSError/ProtocolError when the connection broke or the reply does not
    fit. `spin_s`: polling before sleeping (recv_until_eof)."""
    length = len(mem)
    head = bytearray(RESP.size)
    is_read = op == Op.READ
    got = recv_until_eof(sock, [memoryview(head), mem] if is_read else [memoryview(head)], spin_s)
    if got < RESP.size:
        raise ConnectionError("connection closed with the reply missing")
    status, got_id, got_length = RESP.unpack(head)
    if got_id != rid:
        raise ProtocolError(f"reply for request {got_id}, expected {rid}")
    if status != Status.OK:
        return int(status)
    if is_read and got_length != length:
        raise ProtocolError(f"read reply of {got_length} bytes, expected {length}")
    if got < (RESP.size + length if is_read else RESP.size):
        raise ConnectionError("connection closed in the middle of a read reply")
    return int(Status.OK)


def _advance(bufs: Sequence[bytes | memoryview], n: int) -> list:
    out: list = []
    for i, b in enumerate(bufs):
        size = len(b)
        if n < size:
            out.append(memoryview(b)[n:])
            out.extend(bufs[i + 1 :])
            return out
        n -= size
    return out


def tune(sock: socket.socket, timeout_s: float = 0.0) -> None:
    """TCP_NODELAY, large buffers, keepalive; kernel-side send/receive timeouts (the socket
    stays in blocking mode so MSG_WAITALL moves a whole slice in one syscall)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(None)
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def server_handshake(
    sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Authenticate a freshly accepted client within `timeout_s` seconds in all; raises
    AuthError (wrong secret, or no complete handshake by then), ProtocolError or OSError.
    Leaves the socket in blocking mode without a timeout."""
    deadline = time.monotonic() + timeout_s
    server_nonce = os.urandom(NONCE_BYTES)
    try:
        send_by(sock, HELLO.pack(MAGIC, VERSION, 0, server_nonce), deadline)
        buf = bytearray(AUTH.size)
        recv_exact_by(sock, buf, deadline)
        magic, version, _flags, client_nonce, mac = AUTH.unpack(buf)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"bad hello from client: magic {magic!r} version {version}")
        if not hmac.compare_digest(mac, _mac(secret, b"c", server_nonce, client_nonce)):
            raise AuthError("client failed the cluster-secret challenge")
        send_by(sock, _mac(secret, b"s", client_nonce, server_nonce), deadline)
    except TimeoutError as e:
        raise AuthError(f"no complete handshake within {timeout_s:g} s ({e})") from e
    finally:
        sock.settimeout(None)


def recv_exact_by(sock: socket.socket, buf: bytearray | memoryview, deadline: float) -> None:
    """Fill `buf` before time.monotonic() reaches `deadline`, however the bytes trickle in;
    raises TimeoutError when it passes first, ConnectionError on EOF."""
    view = memoryview(buf)
    got, total = 0, len(view)
    while got < total:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {total} bytes came before the deadline")
        sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send `data` before `deadline` (time.monotonic()); raises TimeoutError otherwise."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed before sending")
    sock.settimeout(left)
    sock.sendall(data)


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove knowledge of `secret` to the server and check that it knows it too."""
    buf = bytearray(HELLO.size)
    recv_exact(sock, buf)
    magic, version, _flags, server_nonce = HELLO.unpack(buf)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"peer is not a mooncake transfer server (magic {magic!r})")
    client_nonce = os.urandom(NONCE_BYTES)
    mac = _mac(secret, b"c", server_nonce, client_nonce)
    sock.sendall(AUTH.pack(MAGIC, VERSION, 0, client_nonce, mac))
    proof = bytearray(PROOF_BYTES)
    recv_exact(sock, proof)
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"s", client_nonce, server_nonce)):
        raise AuthError("transfer server failed the cluster-secret challenge")


def connect(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """An authenticated, tuned data-plane connection; raises OSError/AuthError/ProtocolError.

    A refused handshake (wrong secret) shows up as AuthError on one side and, on the other,
    as the server closing the connection (ConnectionError)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tune(sock, timeout_s)
        client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock
