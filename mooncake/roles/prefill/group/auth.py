"""Who may open a link between pipeline stages: a mutual HMAC-SHA256 challenge on the
cluster secret, each side within one deadline for the whole exchange (a peer trickling
bytes is cut off at the deadline, not after each read).

    server -> client  "MCSL-HELLO-v1" + server nonce (32 B)
    client -> server  client nonce (32 B) + HMAC(secret, "client"|sn|cn)
    server -> client  HMAC(secret, "server"|cn|sn)      (the client checks the server too)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from typing import Final

from mooncake.errors import AuthError, ConfigError
from mooncake.transfer import wire

_HELLO: Final = b"MCSL-HELLO-v1"
_NONCE_BYTES: Final = 32
_MAC_BYTES: Final = 32


def _mac(secret: bytes, label: bytes, *nonces: bytes) -> bytes:
    return hmac.new(
        secret, b"mooncake-stage|" + label + b"|" + b"".join(nonces), hashlib.sha256
    ).digest()


def check_secret(secret: bytes) -> None:
    """Raise ConfigError for a secret too short to resist guessing from a handshake."""
    if len(secret) < 16:
        raise ConfigError("pipeline stages need a cluster secret of at least 16 bytes")


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Prove to the stage on `sock` that we know `secret`, and check that it does, before
    `deadline` (time.monotonic()); raises AuthError, TimeoutError or OSError."""
    check_secret(secret)
    hello = bytearray(len(_HELLO) + _NONCE_BYTES)
    wire.recv_exact_by(sock, hello, deadline)
    if not hello.startswith(_HELLO):
        raise AuthError("the peer is not a mooncake pipeline stage")
    server_nonce, my_nonce = bytes(hello[len(_HELLO) :]), os.urandom(_NONCE_BYTES)
    wire.send_by(sock, my_nonce + _mac(secret, b"client", server_nonce, my_nonce), deadline)
    proof = bytearray(_MAC_BYTES)
    try:
        wire.recv_exact_by(sock, proof, deadline)
    except ConnectionError as e:  # a server that refused our proof just hangs up
        raise AuthError("the pipeline stage does not know the cluster secret") from e
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"server", my_nonce, server_nonce)):
        raise AuthError("the pipeline stage does not know the cluster secret")


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """The accepting side of `client_handshake`; raises AuthError, TimeoutError or OSError."""
    nonce = os.urandom(_NONCE_BYTES)
    wire.send_by(sock, _HELLO + nonce, deadline)
    reply = bytearray(_NONCE_BYTES + _MAC_BYTES)
    wire.recv_exact_by(sock, reply, deadline)
    client_nonce = bytes(reply[:_NONCE_BYTES])
    if not hmac.compare_digest(
        bytes(reply[_NONCE_BYTES:]), _mac(secret, b"client", nonce, client_nonce)
    ):
        raise AuthError("it does not know the cluster secret")
    wire.send_by(sock, _mac(secret, b"server", client_nonce, nonce), deadline)
