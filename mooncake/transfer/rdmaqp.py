"""Accounting of RDMA work in flight, per queue pair and per completion queue, and what a
completion status means.

A `QueuePair` is one incarnation of an RC QP: its generation (unique per transport, carried
in the high bits of every work request id it posts, so a completion of a destroyed QP is
recognised and ignored), the slices it has in flight (never more than its send queue's
depth) and its state: READY (posts), ERROR (posts nothing; its flushed work is being
drained) or CLOSED (destroyed once drained). `Credits` counts a CQ's free entries: a work
request is posted only with one, so the CQ can never overrun. `classify` sorts completion
statuses into: retry on another path, resolve the segment's descriptor again, or fatal.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from mooncake.transfer.batch import Slice

GEN_SHIFT = 32  # wr_id = generation << GEN_SHIFT | sequence number


class QpState(enum.Enum):
    READY = "ready"
    ERROR = "error"  # moved to the error state; waits for its outstanding work to flush
    CLOSED = "closed"


class QueuePair:
    """One RC QP of a path, in slot `slot`, with its work in flight by wr_id."""

    __slots__ = ("depth", "gen", "inflight", "qp", "slot", "state", "_seq")

    def __init__(self, qp: Any, gen: int, slot: int, depth: int):
        self.qp = qp
        self.gen = gen
        self.slot = slot
        self.depth = depth  # the send queue's size: at most this many work requests in flight
        self.state = QpState.READY
        self.inflight: dict[int, Slice] = {}
        self._seq = 0

    @property
    def has_room(self) -> bool:
        return self.state is QpState.READY and len(self.inflight) < self.depth

    def next_wr_id(self) -> int:
        self._seq = (self._seq + 1) & ((1 << GEN_SHIFT) - 1)
        return self.gen << GEN_SHIFT | self._seq

    @property
    def is_drained(self) -> bool:
        return self.state is QpState.ERROR and not self.inflight


def generation_of(wr_id: int) -> int:
    return wr_id >> GEN_SHIFT


class Credits:
    """Free entries of one completion queue; take() never blocks, wait_busy() does."""

    def __init__(self, total: int):
        self.total = total
        self.free = total
        self.max_used = 0  # most entries ever in use (a figure for tests and stats)
        self.stopped = False
        self._cond = threading.Condition()

    def take(self) -> bool:
        with self._cond:
            if self.free == 0:
                return False
            self.free -= 1
            used = self.total - self.free
            if used > self.max_used:
                self.max_used = used
            if used == 1:
                self._cond.notify_all()  # the poller may be asleep on an idle CQ
            return True

    def give(self, count: int = 1) -> None:
        with self._cond:
            self.free += count
            assert self.free <= self.total, "a completion was counted twice"

    @property
    def used(self) -> int:
        return self.total - self.free

    def wait_busy(self) -> None:
        """Return once something is in flight or stop() was called."""
        with self._cond:
            while self.free == self.total and not self.stopped:
                self._cond.wait()

    def stop(self) -> None:
        """Wake the poller for good (the transport is closing)."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"  # the link, the QP or the peer's NIC: another path may work
    RESOLVE = "resolve"  # the peer refused our rkey or range: the descriptor is stale
    FATAL = "fatal"  # our own request was wrong: retrying it anywhere fails the same way


def classify(verbs: Any, status: int) -> Outcome:
    """What a work completion's `status` means for its slice."""
    if status == int(verbs.IBV_WC_SUCCESS):
        return Outcome.OK
    if status in (int(verbs.IBV_WC_REM_ACCESS_ERR), int(verbs.IBV_WC_REM_INV_REQ_ERR)):
        return Outcome.RESOLVE
    fatal = (
        verbs.IBV_WC_LOC_LEN_ERR,
        verbs.IBV_WC_LOC_QP_OP_ERR,
        verbs.IBV_WC_LOC_PROT_ERR,
        verbs.IBV_WC_LOC_ACCESS_ERR,
    )
    if status in {int(s) for s in fatal}:
        return Outcome.FATAL
    return Outcome.RETRY  # RETRY_EXC, RNR_RETRY_EXC, WR_FLUSH, REM_OP, FATAL_ERR, GENERAL...
