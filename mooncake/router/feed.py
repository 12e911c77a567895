"""`BackendFeed`: one vLLM instance's KV event feed, read on a thread of its own.

    feed = BackendFeed(backend, topic, block_map, lock, resync_s=1.0, replay_timeout_s=5.0)
    feed.start() ... feed.stop()

Sequence numbers must grow by one per batch. A gap (a batch dropped by ZeroMQ, a feed
joined late) is filled from the instance's replay socket; a number lower than the last
one, on a batch made after the last one applied, means the instance restarted: what it
held is forgotten (its new cache is empty) and its buffer replayed from 0. With no
replay socket a gap is logged and skipped (blocks chained from a missed one are then not
indexed: `BlockMap`). A quiet spell of `resync_s` asks the replay socket for anything
after the last batch seen (the last batch before a silence is otherwise never known to
be missing). Both sockets refuse a frame over `max_batch_bytes` (`[router]
max_batch_bytes`) by its announced length, before buffering it.
"""

from __future__ import annotations

import logging
import threading

import zmq

from mooncake.config.router import VllmBackend
from mooncake.kvevents.wire import KVEventBatch, WireError, decode_batch, parse_seq, seq_bytes
from mooncake.router.blockmap import BlockMap

log = logging.getLogger(__name__)


class BackendFeed:
    """Subscribes to one backend's events and applies them to its `BlockMap`."""

    def __init__(
        self,
        backend: VllmBackend,
        topic: str,
        blocks: BlockMap,
        lock: threading.Lock,  # the Conductor's: held while a batch is applied
        *,
        resync_s: float,  # quiet seconds before the replay socket is asked
        replay_timeout_s: float,  # seconds the replay socket may take to answer
        max_batch_bytes: int = 16 << 20,  # bytes: a larger frame drops its connection
    ):
        self.backend = backend
        self.topic = topic
        self.blocks = blocks
        self.lock = lock
        self.resync_s = resync_s
        self.replay_timeout_s = replay_timeout_s
        self.max_batch_bytes = max_batch_bytes
        self.next_seq = 0  # the first sequence number not applied yet
        self._last_ts = 0.0  # ts of the last batch applied (a restart's are later)
        self.num_batches = 0
        self.num_replayed = 0  # batches that came from the replay socket
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"feed-{blocks.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _subscribe(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], zmq.Poller]:
        """A SUB socket on the backend's events, a monitor of its disconnections, and a
        poller of both."""
        sub = self._ctx.socket(zmq.SUB)
        # NOTE: checked on the frame's announced length, before any of it is buffered
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.backend.events)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return sub, monitor, poller

    def _run(self) -> None:
        sub, monitor, poller = self._subscribe()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(self.resync_s * 1000)))
                if monitor in ready:
                    # NOTE: ZeroMQ reconnects after a connection error but not after a
                    # protocol error (a frame over MAXMSGSIZE): subscribe again either way
                    monitor.recv_multipart()
                    log.warning(
                        "router: %s's event connection dropped (a frame over "
                        "router.max_batch_bytes = %d, or the backend went away): "
                        "subscribing again",
                        self.blocks.name,
                        self.max_batch_bytes,
                    )
                    self._close(sub, monitor)
                    sub, monitor, poller = self._subscribe()
                    continue
                if sub not in ready:
                    self._replay()
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("router: %s sent %d frames, not 3", self.blocks.name, len(frames))
                    continue
                self._take(parse_seq(frames[1]), frames[2], replayed=False)
        except Exception:  # a bug must be seen; routing goes on with what is indexed
            log.exception("router: the feed of %s failed", self.blocks.name)
        finally:
            self._close(sub, monitor)

    @staticmethod
    def _close(sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)

    def _take(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        try:
            batch: KVEventBatch | None = decode_batch(payload)
        except WireError as e:
            log.warning("router: %s batch %d: %s", self.blocks.name, seq, e)
            batch = None
        if seq < self.next_seq:
            # NOTE: a batch already applied (live after a replay got it, or replayed after
            # live) is no newer than the last one applied; one made later is a restart's
            if replayed or batch is None or batch.ts <= self._last_ts:
                return
            log.warning(
                "router: %s restarted (seq %d after %d): its cache is empty",
                self.blocks.name,
                seq,
                self.next_seq,
            )
            with self.lock:
                self.blocks.clear()
            self.next_seq = 0
        if seq > self.next_seq and not replayed and self.backend.replay:
            self._replay()  # NOTE: fills [next_seq, seq] from the instance's buffer
            if seq < self.next_seq:
                return
        if seq > self.next_seq:
            log.warning(
                "router: %s: batches %d..%d missed", self.blocks.name, self.next_seq, seq - 1
            )
        if batch is not None:
            with self.lock:
                self.blocks.apply(batch)
            self._last_ts = batch.ts
        self.next_seq = seq + 1
        self.num_batches += 1
        self.num_replayed += replayed

    def _replay(self) -> None:
        """Ask for every batch from next_seq on; apply them (no-op without a replay socket)."""
        if not self.backend.replay:
            return
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes)
        req.connect(self.backend.replay)
        try:
            req.send_multipart([b"", seq_bytes(self.next_seq)])
            while req.poll(int(self.replay_timeout_s * 1000)):
                frames = req.recv_multipart()
                if len(frames) != 4:
                    return
                seq = parse_seq(frames[2])
                if seq < 0:
                    return  # the end marker
                self._take(seq, frames[3], replayed=True)
            log.warning(
                "router: %s's replay socket did not answer in %g s",
                self.blocks.name,
                self.replay_timeout_s,
            )
        finally:
            req.close(linger=0)
