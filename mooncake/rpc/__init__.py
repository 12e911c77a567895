"""Control-plane RPC: typed messages (msgspec, msgpack) over ZeroMQ, authenticated by CURVE.

Use
---
    from mooncake.rpc import Msg, Peer, RpcClient, RpcServer

    class EchoMsg(Msg, frozen=True, tag="demo.echo"):  # a stable namespaced tag names the type
        text: str

    def echo(msg: EchoMsg, peer: Peer) -> EchoMsg:  # raise a MooncakeError to refuse
        return msg

    server = RpcServer("tcp://127.0.0.1:0", secret)
    server.register(EchoMsg, echo)               # requests: handler returns the reply Msg
    server.on_event(HeartbeatMsg, on_heartbeat)  # one-way events: handler returns None
    server.start()                               # server.address has the real port
    client = RpcClient(server.address, secret, timeout_s=5.0)
    reply = client.call(EchoMsg("hi"), reply_type=EchoMsg, timeout_s=1.0)
    client.send_event(HeartbeatMsg(...))
    client.close(); server.stop()

`AsyncRpcClient` has the same `call`/`send_event`/`close` as coroutines (zmq.asyncio).
`peer` is a `Peer(routing_id, address)`: who sent the message, for logs; a component that
needs to call back puts its own address in its messages.

Threads
-------
The server runs its loop on one thread and calls handlers there, one at a time: handlers
never race each other, and a slow handler delays every caller. `RpcClient` is thread-safe:
each calling thread gets its own connection, so calls from several threads run in
parallel without a lock. `AsyncRpcClient` serves any number of coroutines of one event loop
(about 2-3x the latency of `RpcClient`: asyncio's own overhead).

Latency (`mooncake bench rpc`, 2-core VM shared with other work, loopback): an
authenticated echo takes ~60-95 us p50, within ~10 us of bare pyzmq with CURVE; the cost
is libzmq's I/O threads (six thread wake-ups per round trip against two for a raw socket),
not CURVE (~1.7 us per encryption with libsodium) nor msgspec (~5 us of Python per side).

Errors (mooncake.errors)
------------------------
- `RpcTimeout`: no connection within the timeout (server down; requests are never queued
  while disconnected), or no reply in time. A reply arriving after its call timed out is
  recognised by its request id and dropped, never handed to a later call.
- `AuthError`: the server refused our CURVE handshake (a different cluster secret); raised
  as soon as the handshake fails (about a millisecond), not at the end of the timeout.
- `RemoteError(RpcError)`: the handler raised; `remote_type` is the exception's class name
  (e.g. "StoreError"), `remote_message` its message, `code` "error" for a MooncakeError and
  "internal" for a crash. `RemoteProtocolError` (also a `ProtocolError`): the server could
  not decode our request.
- `ProtocolError`: a malformed frame; on the server it is logged with the peer's address,
  answered with an error reply when the frame was a request, and the server goes on.

Wire
----
One frame per message: an 11-byte binary header (version, kind, request id, tag length),
the tag, and the msgpack body (see `mooncake.rpc.wire`). The receiver decodes only the tags
it registered, with size limits (`max_frame_bytes`, default 8 MiB: zmq MAXMSGSIZE on every
socket, and again in the decoder); nothing is ever unpickled. A peer that sends a larger
frame is disconnected by zmq, so a reply larger than the client's limit ends as RpcTimeout.

Security
--------
Every socket uses ZeroMQ CURVE (CurveZMQ: Curve25519, XSalsa20-Poly1305). The server and
client keypairs are derived from the cluster secret (BLAKE2b with a per-role salt), and the
server's ZAP handler admits only the derived client key, so:
- a peer without the secret cannot finish the handshake, so it can call nothing and send
  no event: no byte it sends reaches a decoder or a handler;
- an eavesdropper sees only endpoints, timing and sizes: every message is encrypted and
  authenticated, with per-connection ephemeral keys (forward secrecy: a later leak of the
  secret does not decrypt recorded traffic); replayed or altered frames are rejected;
- every holder of the secret is fully trusted: it can act as any client or impersonate a
  server. There are no per-node identities or permissions;
- a captured handshake lets an attacker test guesses of the secret offline, so the secret
  must be random (at least 16 bytes are required; `openssl rand -hex 32`).
`secret=None` turns CURVE off (plain text, no authentication): benchmarks and tests only.
"""

from mooncake.rpc.aio import AsyncRpcClient
from mooncake.rpc.auth import CurveKeypair, derive_keypair
from mooncake.rpc.client import RpcClient
from mooncake.rpc.server import Peer, RpcServer
from mooncake.rpc.wire import ErrorMsg, Msg, RemoteError, RemoteProtocolError

__all__ = [
    "AsyncRpcClient",
    "CurveKeypair",
    "ErrorMsg",
    "Msg",
    "Peer",
    "RemoteError",
    "RemoteProtocolError",
    "RpcClient",
    "RpcServer",
    "derive_keypair",
]
