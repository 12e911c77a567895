"""`Publisher`: KV event batches on a ZeroMQ PUB socket, with vLLM's replay ROUTER socket.

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="", buffer_steps=10_000)
    pub.publish([batch, ...])     # any thread; numbered and sent on the publisher's thread
    pub.endpoint, pub.replay_endpoint   # the bound addresses (real ports)
    pub.close()

Framing and replay are vLLM's (`mooncake.kvevents.wire`): a subscriber written for vLLM's
`ZmqEventPublisher` reads this one unchanged. Sequence numbers start at 0 and grow by one
per batch; the last `buffer_steps` batches are kept for replay. One thread owns both
sockets (ZeroMQ sockets are not thread-safe); `publish` hands it batches through a queue
and wakes it through a pipe, so it never polls on a timer.

What subscribers send is small: a subscription (1 byte + the topic), a replay request
(8 bytes), ZeroMQ's handshake commands (a few hundred bytes). Both sockets drop the
connection of a peer announcing a larger frame (`INBOUND_MAX_BYTES` + the topic's length,
zmq MAXMSGSIZE) before buffering any of it, so a peer cannot make the master hold
gigabytes. Neither socket is authenticated (vLLM's format has no authentication): bind
them to loopback or a private network (docs/kv-events.md).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from typing import Final

import zmq

from mooncake.config.portrange import PortRange, bind_zmq
from mooncake.errors import ConfigError
from mooncake.kvevents.wire import END_SEQ, KVEventBatch, encode_batch, seq_bytes

log = logging.getLogger(__name__)

INBOUND_MAX_BYTES: Final = 64 << 10  # a frame a subscriber sends, beyond the topic's length


class Publisher:
    """Owns the PUB and ROUTER sockets and the thread serving them."""

    def __init__(
        self,
        endpoint: str,  # PUB address to bind, e.g. "tcp://127.0.0.1:5557" (port 0 = any)
        replay_endpoint: str = "",  # ROUTER address to bind; "" = no replay
        *,
        topic: str = "",
        buffer_steps: int = 10_000,  # batches kept for replay
        hwm: int = 100_000,  # batches ZeroMQ queues per subscriber before dropping
        ports: PortRange = PortRange(0, 0),  # where a tcp port 0 binds ([node] port_range)
    ):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[KVEventBatch] = queue.SimpleQueue()
        self._next_seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        max_bytes = INBOUND_MAX_BYTES + len(self._topic)
        self._pub.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        try:
            self.endpoint = _bind(self._pub, endpoint, "kv_events.endpoint", ports)
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, max_bytes)
                self.replay_endpoint = _bind(
                    self._replay, replay_endpoint, "kv_events.replay_endpoint", ports
                )
        except ConfigError:
            self._close_sockets()
            raise
        self._wake_r, self._wake_w = os.pipe()
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batches: list[KVEventBatch]) -> None:
        """Queue batches to be numbered and sent in this order (returns at once)."""
        if self._is_closed or not batches:
            return
        for b in batches:
            self._queue.put(b)
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if self._is_closed:
            return
        self._is_closed = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    self._send_queued()
                    if self._is_closed:
                        return
        except Exception:  # a bug must be seen; the master goes on without a feed
            log.exception("kv events: the publisher thread failed")
        finally:
            self._close_sockets()

    def _send_queued(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            seq, payload = self._next_seq, encode_batch(batch)
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _bind(sock: zmq.Socket, endpoint: str, key: str, ports: PortRange) -> str:
    """Bind and return the bound address (the real port for port 0: in `ports`)."""
    try:
        bind_zmq(sock, endpoint, ports)
    except zmq.ZMQError as e:
        raise ConfigError(
            f"{key}: cannot bind {endpoint!r} ({e}); use tcp://HOST:PORT (port 0 = any free) "
            "or ipc://PATH"
        ) from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
