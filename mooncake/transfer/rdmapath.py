"""One RDMA path: the queue pairs from one local NIC to one NIC of a peer, and the slices
waiting for room on them.

`dispatch` queues slices and `pump` posts as many as the path's QPs (their send queue
depth) and the local NIC's CQ (its `Credits`) have room for; the NIC's poller pumps again
as completions free room. QP slots are connected by the transport's worker threads, never
by a caller or a poller. A work completion in error moves its QP to the error state (every
work request still on it then completes with WR_FLUSH_ERR, each retried elsewhere by the
engine); the QP is destroyed once its last completion was polled, and its slot connected
again when work needs it. Posting and destroying both hold the path's lock, so nothing is
posted on a QP being destroyed.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from mooncake.errors import MooncakeError, TransferError
from mooncake.native.rdma import RdmaNic
from mooncake.transfer.batch import Slice
from mooncake.transfer.paths import Path
from mooncake.transfer.rdmamr import SegmentGone
from mooncake.transfer.rdmaqp import Credits, QpState, QueuePair
from mooncake.transfer.transport import Report
from mooncake.transfer.types import EngineOptions

log = logging.getLogger(__name__)
CONNECT_ERRORS = (OSError, MooncakeError, msgspec.DecodeError)


class PathOwner(Protocol):
    """What an RdmaPath needs of its transport (transfer/rdma.py's RdmaTransport): the
    engine's options, the local NICs and their CQ credits, posting a slice and releasing it
    once its work request is gone, running work on a worker thread, reporting a slice, and
    connecting, adopting and forgetting QPs."""

    options: EngineOptions
    nics: dict[str, RdmaNic]
    credits: dict[str, Credits]
    report: Report

    def post(self, nic: RdmaNic, qp: Any, wr_id: int, s: Slice, remote_nic: str) -> None: ...

    def unpost(self, s: Slice) -> None: ...

    def later(self, fn: Callable[..., object], *args: Any) -> None: ...

    def connect(self, path: RdmaPath, slots: list[int]) -> list[tuple[int, Any]]: ...

    def adopt_qp(self, path: RdmaPath, qp: Any, slot: int) -> QueuePair: ...

    def forget_qp(self, q: QueuePair) -> None: ...


class RdmaPath(Path):
    """Queue pairs from one local NIC to one NIC of a peer; connected on first use."""

    def __init__(self, transport: PathOwner, host: str, port: int, local_nic: str, remote_nic: str):
        opts = transport.options
        key = f"rdma {local_nic}->{remote_nic}@{host}:{port}"
        super().__init__(key, local_nic, remote_nic, opts.pause_after_failures, opts.pause_s)
        self.transport = transport
        self.host, self.port = host, port
        self.nic = transport.nics[local_nic]
        self.credits = transport.credits[local_nic]
        self.path_id = secrets.randbits(62)  # the responder keys our QPs by it
        self.slots: list[QueuePair | None] = [None] * opts.connections_per_peer
        self.pending: collections.deque[Slice] = collections.deque()
        self.lock = threading.Lock()
        self.connecting = False
        self.closed = False
        self._connect_after = 0.0  # time.monotonic() before which no new connect is tried
        self._connect_error = ""  # why the last connect failed
        self._retry_connect_s = opts.pause_s
        self._rr = 0

    def dispatch(self, slices: list[Slice]) -> None:
        with self.lock:
            self.pending.extend(slices)
        self.pump()

    def pump(self) -> None:
        """Post pending slices while a QP and the CQ have room (never blocks)."""
        failed: list[tuple[Slice, str]] = []
        gone: list[tuple[Slice, str]] = []  # slices of unregistered segments: not retried
        with self.lock:
            if self.closed:
                return
            live = [q for q in self.slots if q is not None and q.state is QpState.READY]
            if not self._maybe_connect() and not live and not self.connecting:
                # NOTE: no QP and no connect before the backoff ends: other paths, now
                why = f"{self.key}: not connected (last connect: {self._connect_error})"
                failed = [(s, why) for s in self.pending]
                self.pending.clear()
            while self.pending and live:
                n = len(live)
                for k in range(n):
                    q = live[(self._rr + k) % n]
                    if len(q.inflight) < q.depth:
                        break
                else:
                    break  # every QP's send queue is full: the poller pumps again
                self._rr = (self._rr + k + 1) % n
                if not self.credits.take():
                    break  # the CQ is full: the poller pumps again
                s = self.pending.popleft()
                if not s.batch.is_live(s.index):
                    self.credits.give()
                    continue
                wr_id = q.next_wr_id()
                q.inflight[wr_id] = s
                try:
                    self.transport.post(self.nic, q.qp, wr_id, s, self.remote_nic)
                except SegmentGone as e:  # NOTE: not the path's fault: the QP stays ready
                    del q.inflight[wr_id]
                    self.credits.give()
                    gone.append((s, str(e)))
                except TransferError as e:
                    del q.inflight[wr_id]
                    self.credits.give()
                    failed.append((s, f"{self.key}: {e}"))
                    log.warning("%s: %s; its QP goes to the error state", self.key, e)
                    self._to_error(q)
                    live = [q for q in live if q.state is QpState.READY]
        for s, error in failed:
            self.transport.later(self.transport.report, s, error, True)
        for s, error in gone:
            self.transport.later(self.transport.report, s, error, False, False)

    def completed(self, q: QueuePair, wr_id: int, ok: bool) -> Slice | None:
        """The slice of a polled completion of `q` (None: not ours any more)."""
        with self.lock:
            s = q.inflight.pop(wr_id, None)
            if not ok:
                self._to_error(q)
            elif q.is_drained:
                self._retire(q)
        if s is not None:
            self.transport.unpost(s)
        return s

    def _to_error(self, q: QueuePair) -> None:
        """Under the lock: stop posting on `q` and flush its work; destroy it once drained."""
        if q.state is QpState.READY:
            q.state = QpState.ERROR
            try:
                self.nic.to_error(q.qp)
            except TransferError as e:  # NOTE: its work still completes (in error)
                log.warning("%s: %s", self.key, e)
        if q.is_drained:
            self._retire(q)

    def _retire(self, q: QueuePair) -> None:
        """Under the lock: destroy drained `q`; its slot is connected again when needed."""
        q.state = QpState.CLOSED
        self.slots[q.slot] = None
        self.transport.forget_qp(q)
        try:
            self.nic.call("destroy_qp", q.qp.close)
        except TransferError as e:
            log.warning("%s: %s", self.key, e)
        for s in q.inflight.values():  # NOTE: only at close: destroyed, they never execute
            self.transport.unpost(s)
        q.inflight.clear()

    def _maybe_connect(self) -> bool:
        """Under the lock: ask a worker to connect the empty slots if work waits; False if
        a connect is due but waits for the backoff after a failed one."""
        if self.connecting or not self.pending or None not in self.slots:
            return True
        if time.monotonic() < self._connect_after:
            return False
        self.connecting = True
        self.transport.later(self._connect_slots)
        return True

    def _connect_slots(self) -> None:
        """On a worker: connect every empty slot, then pump; on failure, if no QP is left,
        fail the waiting slices (retryable, so the engine tries other paths)."""
        with self.lock:
            slots = [i for i, q in enumerate(self.slots) if q is None]
        try:
            made = self.transport.connect(self, slots) if slots else []
        except CONNECT_ERRORS as e:
            with self.lock:
                self.connecting = False
                self._connect_after = time.monotonic() + self._retry_connect_s
                self._connect_error = str(e)
                stranded: list[Slice] = []
                if not any(q is not None and q.state is QpState.READY for q in self.slots):
                    stranded, self.pending = list(self.pending), collections.deque()
            log.warning("%s: connect failed: %s", self.key, e)
            for s in stranded:
                self.transport.report(s, f"{self.key}: connect failed: {e}", True)
            return
        with self.lock:
            self.connecting = False
            if self.closed:
                for _, qp in made:
                    self.nic.call("destroy_qp", qp.close)
                return
            for slot, qp in made:
                q = self.transport.adopt_qp(self, qp, slot)
                self.slots[slot] = q
        self.pump()

    def close(self) -> None:
        """Destroy every QP (pollers are stopped: nothing completes any more)."""
        with self.lock:
            self.closed = True
            self.pending.clear()
            for q in self.slots:
                if q is not None:
                    self._retire(q)

    def qps(self) -> list[Any]:
        """The live pyverbs QPs (for tests and stats)."""
        with self.lock:
            return [q.qp for q in self.slots if q is not None and q.state is QpState.READY]
