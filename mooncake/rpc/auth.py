"""Cluster-secret authentication: CURVE keys derived from the secret, a ZAP gate, handshake watch.

Both keypairs (server and client) are derived from the cluster secret with BLAKE2b
(personalised "mooncake-rpc-v1", salted with the role), so every process of the cluster
computes the same keys without any key file. A server is a CURVE server with the server
keypair; its ZAP handler admits only clients that present the derived client public key.
A peer without the secret cannot compute the server public key, so its handshake fails
before any message is read; see the `mooncake.rpc` docstring for the security properties.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import struct
import time
from typing import Any, Final, Literal

import msgspec
import zmq
from zmq.utils import z85

from mooncake.errors import ConfigError

log = logging.getLogger(__name__)

MIN_SECRET_BYTES: Final = 16  # a shorter secret could be brute-forced from a captured handshake
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC, one per zmq context
_PERSON: Final = b"mooncake-rpc-v1"
_FAILED_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class CurveKeypair(msgspec.Struct, frozen=True):
    """A Curve25519 keypair in Z85 text form, as zmq socket options take it."""

    public: bytes  # 40 Z85 characters
    secret: bytes  # 40 Z85 characters; never log this


def check_secret(secret: bytes) -> None:
    """Raise ConfigError unless `secret` is bytes of at least MIN_SECRET_BYTES."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ConfigError(
            f"cluster secret: need at least {MIN_SECRET_BYTES} random bytes, got {got}; "
            "generate one with `openssl rand -hex 32`"
        )


@functools.lru_cache(maxsize=16)
def derive_keypair(secret: bytes, role: Literal["server", "client"]) -> CurveKeypair:
    """The keypair of `role` for the cluster `secret`: identical in every process, every run."""
    check_secret(secret)
    assert role in ("server", "client"), role
    seed = hashlib.blake2b(secret, digest_size=32, person=_PERSON, salt=role.encode()).digest()
    secret_z85 = z85.encode(seed)  # Curve25519 clamps any 32 bytes into a valid secret key
    return CurveKeypair(public=zmq.curve_public(secret_z85), secret=secret_z85)


def secure_server(sock: zmq.Socket[Any], secret: bytes | None) -> None:
    """Make `sock` a CURVE server for the cluster (no-op when `secret` is None: no auth)."""
    if secret is None:
        return
    sock.curve_secretkey = derive_keypair(secret, "server").secret
    sock.curve_server = True


def secure_client(sock: zmq.Socket[Any], secret: bytes | None) -> None:
    """Make `sock` a CURVE client of the cluster's servers (no-op when `secret` is None)."""
    if secret is None:
        return
    mine = derive_keypair(secret, "client")
    sock.curve_secretkey = mine.secret
    sock.curve_publickey = mine.public
    sock.curve_serverkey = derive_keypair(secret, "server").public


class ZapHandler:
    """Answers the ZAP requests of one zmq context: admits only the cluster's client key.

    Runs `run()` on its own thread until the context is terminated: a handshake must not
    wait for a busy request handler, and the request loop must not poll for handshakes.
    """

    def __init__(self, ctx: zmq.Context[Any], secret: bytes):
        self._client_key = z85.decode(derive_keypair(secret, "client").public)  # 32 raw bytes
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        """Read one ZAP request and answer it (200 admits, 400 refuses)."""
        frames = self.sock.recv_multipart()
        # version, request id, domain, address, identity, mechanism, credentials...
        request_id = frames[1] if len(frames) > 1 else b""
        if len(frames) < 6 or frames[0] != b"1.0":
            self.sock.send_multipart([b"1.0", request_id, b"500", b"bad ZAP request", b"", b""])
            return
        address, mechanism, credentials = frames[3], frames[5], frames[6:]
        if (
            mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], self._client_key)
        ):
            self.sock.send_multipart([b"1.0", request_id, b"200", b"OK", b"cluster", b""])
            return
        log.warning(
            "refused a %s connection from %s: it does not present the cluster's client key "
            "(a different cluster secret?)",
            mechanism.decode("ascii", "replace"),
            address.decode("ascii", "replace"),
        )
        self.sock.send_multipart([b"1.0", request_id, b"400", b"unknown key", b"", b""])

    def run(self) -> None:
        """Answer ZAP requests until the context is terminated, then close the socket."""
        try:
            while True:
                self.handle()
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close(linger=0)


class HandshakeWatch:
    """Remembers whether the CURVE handshakes of a socket fail, to tell 'refused' from 'down'.

    Reads the socket's monitor only when asked (after a timeout), so it costs nothing per call.
    """

    def __init__(self, sock: zmq.Socket[Any]):
        # NOTE: a plain (sync) PAIR on the same C context also works for zmq.asyncio sockets.
        endpoint = f"inproc://mooncake.rpc.monitor.{id(sock):x}.{time.monotonic_ns():x}"
        sock.monitor(endpoint, _FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._ctx: zmq.Context[Any] = zmq.Context.shadow(sock.context.underlying)
        self.pair: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        self.pair.linger = 0
        self.pair.connect(endpoint)
        self._sock = sock
        self.is_refused = False  # the last handshake outcome seen was a failure

    def poll(self) -> bool:
        """Drain pending monitor events; True if the last handshake seen failed."""
        while True:
            try:
                head, _endpoint = self.pair.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.is_refused
            event = struct.unpack("=Hi", head[:6])[0] if len(head) >= 6 else 0
            self.is_refused = bool(event & _FAILED_EVENTS)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the socket may be closed already
            self._sock.disable_monitor()
        self.pair.close(linger=0)
