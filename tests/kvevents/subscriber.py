"""A subscriber to a vLLM-format KV event feed written as a router would write it: pyzmq
and msgspec's msgpack decoding only (no mooncake import), with vLLM's replay protocol."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class Subscriber:
    """Receives (seq, batch) in order; a gap or a quiet spell is filled from the replay
    socket. `batches` has every batch seen, `replayed` the seqs that came by replay."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b""):
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.next_seq = 0  # the first seq not yet seen
        self.batches: list[tuple[int, list[Any]]] = []  # (seq, decoded [ts, events, rank])
        self.replayed: list[int] = []
        self.sub: zmq.Socket | None = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def disconnect(self) -> None:
        assert self.sub is not None
        self.sub.close(linger=0)
        self.sub = None

    def _take(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        assert seq >= self.next_seq or replayed, (seq, self.next_seq)
        if seq < self.next_seq:
            return  # already seen live
        assert seq == self.next_seq, f"gap not filled: got {seq}, expected {self.next_seq}"
        self.batches.append((seq, msgspec.msgpack.decode(payload)))
        if replayed:
            self.replayed.append(seq)
        self.next_seq = seq + 1

    def replay(self, start: int) -> None:
        """Ask the replay socket for every batch from `start` on."""
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert req.poll(10_000), "the replay socket did not answer"
                empty, topic, seq_b, payload = req.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return
                assert empty == b"" and topic == self.topic, (empty, topic)
                self._take(seq, payload, replayed=True)
        finally:
            req.close(linger=0)

    def poll(self, wait_s: float) -> None:
        """Take what arrives within `wait_s`; a gap (or nothing at all) asks for a replay."""
        assert self.sub is not None
        if not self.sub.poll(int(wait_s * 1000)):
            self.replay(self.next_seq)
            return
        while self.sub.poll(0):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_b) == 8
            seq = int.from_bytes(seq_b, "big")
            if seq > self.next_seq:
                self.replay(self.next_seq)  # NOTE: fills [next_seq, seq] (and maybe more)
            if seq >= self.next_seq:
                self._take(seq, payload, replayed=False)

    def events(self) -> list[tuple[int | None, dict[str, Any]]]:
        """Every event seen, in order, with its batch's data_parallel_rank."""
        out: list[tuple[int | None, dict[str, Any]]] = []
        for _, batch in self.batches:
            rank = batch[2] if len(batch) > 2 else None
            out.extend((rank, e) for e in batch[1])
        return out

    def wait_for(self, pred: Any, timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred(self):
            assert time.monotonic() < deadline, self.events()[-10:]
            self.poll(poll_s)

    def close(self) -> None:
        if self.sub is not None:
            self.disconnect()
