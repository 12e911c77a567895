"""A submitted batch: its requests, their slices, and the completion bookkeeping that the
transports' worker threads update and the caller polls or waits on.

A request is DONE only when every one of its slices was acknowledged; one slice that fails
for good fails its request (the rest of its slices are skipped). Requests still pending at
the batch deadline become TIMED_OUT, whatever is still in flight.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mooncake.errors import TransferError
from mooncake.transfer.types import RequestStatus, TransferOp, TransferRequest, TransferState

_PENDING = TransferState.PENDING
_DONE = TransferState.DONE


class Slice:
    """A piece of one request, moved by one transport over one path in one operation."""

    __slots__ = (
        "attempt",
        "batch",
        "index",
        "length",
        "local",
        "local_offset",
        "op",
        "path",
        "remote_offset",
        "target",
        "tried",
    )

    def __init__(
        self,
        batch: Batch,
        index: int,
        op: TransferOp,
        local: Any,
        local_offset: int,
        target: Any,
        remote_offset: int,
        length: int,
    ):
        self.batch = batch
        self.index = index  # request index within the batch
        self.op = op
        self.local = local  # Region
        self.local_offset = local_offset  # bytes into the local region
        self.target = target  # the resolved remote segment (engine.Target)
        self.remote_offset = remote_offset  # bytes into the remote segment
        self.length = length  # bytes
        self.attempt = 0  # failed attempts so far
        self.path: Any = None  # the path it is queued on
        self.tried: list[Any] = []  # paths that failed it

    def __repr__(self) -> str:
        return f"Slice(req={self.index} {self.op.name} +{self.remote_offset} {self.length}B)"


def contiguous_runs(slices: list[Slice]) -> list[list[Slice]]:
    """Split `slices` (in order) into runs that continue each other on both sides: same op,
    local segment and remote target, adjacent offsets. A run moves as one operation."""
    runs: list[list[Slice]] = []
    for s in slices:
        if runs:
            last = runs[-1][-1]
            if (
                s.op is last.op
                and s.local is last.local
                and s.target is last.target
                and s.local_offset == last.local_offset + last.length
                and s.remote_offset == last.remote_offset + last.length
            ):
                runs[-1].append(s)
                continue
        runs.append([s])
    return runs


def chunked(slices: list[Slice], max_bytes: int, max_slices: int = 64) -> list[list[Slice]]:
    """`slices` cut into consecutive chunks of at most `max_bytes` (or one bigger slice)."""
    chunks: list[list[Slice]] = []
    chunk: list[Slice] = []
    num_bytes = 0
    for s in slices:
        chunk.append(s)
        num_bytes += s.length
        if num_bytes >= max_bytes or len(chunk) >= max_slices:
            chunks.append(chunk)
            chunk, num_bytes = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


class Batch:
    """Handle of submitted requests: poll(), wait(timeout) and cancel()."""

    def __init__(self, requests: list[TransferRequest], deadline: float):
        self.requests = requests
        self.deadline = deadline  # time.monotonic() after which pending requests time out
        self._lock = threading.Lock()
        self._event: threading.Event | None = None  # made by the first wait() that blocks
        n = len(requests)
        self._states = [_PENDING] * n
        self._reasons = [""] * n
        self._bytes = [0] * n
        self._remaining = [0] * n  # slices not yet acknowledged, per request
        self._num_open = n

    @classmethod
    def done(cls, requests: list[TransferRequest]) -> Batch:
        """A batch whose requests were all moved already (by the caller's own thread)."""
        batch = cls(requests, 0.0)
        batch._states = [_DONE] * len(requests)
        batch._bytes = [r.length for r in requests]
        batch._num_open = 0
        return batch

    def add_slices(self, index: int, count: int) -> None:
        """Called by the engine before dispatching request `index`'s slices."""
        self._remaining[index] += count

    def is_live(self, index: int) -> bool:
        """Whether request `index` still wants its slices moved (workers skip it if not)."""
        return self._states[index] is _PENDING and time.monotonic() < self.deadline

    @property
    def num_open(self) -> int:
        """Requests still pending (without checking the deadline)."""
        return self._num_open

    @property
    def has_failures(self) -> bool:
        """Whether some request ended other than DONE (failed, timed out, cancelled)."""
        return not all(st is _DONE or st is _PENDING for st in self._states)

    def slices_done(self, slices: list[Slice]) -> None:
        """Record acknowledged slices of this batch (called from worker threads)."""
        states, remaining, num_bytes = self._states, self._remaining, self._bytes
        with self._lock:
            for s in slices:
                i = s.index
                if states[i] is _PENDING:
                    num_bytes[i] += s.length
                    remaining[i] -= 1
                    if remaining[i] == 0:
                        self._finish(i, TransferState.DONE, "")

    def fail(self, index: int, reason: str, state: TransferState = TransferState.FAILED) -> None:
        """End request `index` with `state` unless it already ended."""
        with self._lock:
            if self._states[index] is _PENDING:
                self._finish(index, state, reason)

    def _finish(self, i: int, state: TransferState, reason: str) -> None:
        self._states[i] = state
        self._reasons[i] = reason
        self._num_open -= 1
        if self._num_open == 0 and self._event is not None:
            self._event.set()

    def _expire(self) -> None:
        if self._num_open and time.monotonic() >= self.deadline:
            with self._lock:
                for i, st in enumerate(self._states):
                    if st is _PENDING:
                        self._finish(i, TransferState.TIMED_OUT, "batch deadline passed")

    @property
    def is_done(self) -> bool:
        """True once no request is pending (done, failed, timed out or cancelled)."""
        self._expire()
        return self._num_open == 0

    def poll(self) -> list[RequestStatus]:
        """Current status of every request, in submit order; does not block."""
        self._expire()
        with self._lock:
            return [
                RequestStatus(st, b, r)
                for st, b, r in zip(self._states, self._bytes, self._reasons, strict=True)
            ]

    def wait(self, timeout: float | None = None) -> list[RequestStatus]:
        """Block until every request ended, `timeout` seconds passed, or the batch deadline;
        then return poll(). Requests pending at the deadline are marked TIMED_OUT."""
        if self._num_open:  # NOTE: a transfer done by the calling thread skips the Event
            with self._lock:
                if self._num_open and self._event is None:
                    self._event = threading.Event()  # _finish() sets it, under the lock
                event = self._event
            if event is not None:
                now = time.monotonic()
                end = self.deadline if timeout is None else min(self.deadline, now + timeout)
                event.wait(max(0.0, end - now))
        return self.poll()

    def cancel(self) -> None:
        """Stop every pending request (CANCELLED); slices in flight may still land."""
        with self._lock:
            for i, st in enumerate(self._states):
                if st is _PENDING:
                    self._finish(i, TransferState.CANCELLED, "cancelled by the caller")

    def check(self, timeout: float | None = None) -> int:
        """wait(timeout), then raise TransferError unless every request is DONE; returns bytes."""
        if not self._num_open and not self.has_failures:
            return sum(self._bytes)  # NOTE: ended requests never change state again
        statuses = self.wait(timeout)
        bad = [(i, s) for i, s in enumerate(statuses) if s.state is not TransferState.DONE]
        if bad:
            shown = "; ".join(f"request {i}: {s.state.value}: {s.reason}" for i, s in bad[:3])
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise TransferError(f"{len(bad)} of {len(statuses)} transfers failed: {shown}{more}")
        return sum(s.bytes_done for s in statuses)
