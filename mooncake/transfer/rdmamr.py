"""The memory regions (MRs) of one registered segment, one per local NIC, and the work
requests posted against them.

A work request names local memory by an MR's lkey, and the NIC resolves that key when it
executes the request, so an MR must outlive every request posted against it. Closing it
earlier makes the NIC fail the request (LOC_PROT_ERR, which also puts its QP in error) or,
if the key went to a new registration in the meantime, move the bytes of the wrong memory.
Reading the key of a closed pyverbs MR also dereferences NULL. `RegionMrs` reads each
key once, at registration. `acquire` counts a work request before it is posted, and
`release` uncounts it once its completion was polled or its QP destroyed. `close` refuses
new work at once (`acquire` raises `SegmentGone`) and closes the MRs when the count is
zero: at once if it already is, otherwise in `close`'s wait or, if that wait ends first,
in the last `release`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mooncake.errors import TransferError

log = logging.getLogger(__name__)


class SegmentGone(TransferError):
    """The local segment of a slice was unregistered: the slice was not posted."""


class RegionMrs:
    """One segment's MRs by NIC (kept in `Region.rdma_handles`) and their posted work."""

    def __init__(self, name: str, handles: list[tuple[str, Any, int]]):
        self.name = name  # the segment's name (for errors)
        # nic -> (MR, address of the region's byte 0 in work requests, lkey)
        self._by_nic = {nic: (mr, base, int(mr.lkey)) for nic, mr, base in handles}
        self._cond = threading.Condition()
        self.num_posted = 0  # work requests posted against these MRs and not yet released
        self.is_closing = False  # unregistered: nothing new is posted
        self.is_closed = False  # the MRs are closed
        self._is_waiting = False  # close() waits: it closes them itself

    def mrs(self) -> list[Any]:
        """The MRs, one per NIC (for tests and rollback)."""
        return [mr for mr, _, _ in self._by_nic.values()]

    def acquire(self, nic: str) -> tuple[int, int]:
        """(lkey, base address) of `nic`'s MR for one work request about to be posted,
        counted until `release`; raises SegmentGone once the segment was unregistered."""
        with self._cond:
            if self.is_closing:
                raise SegmentGone(
                    f"local segment {self.name!r} was unregistered while the transfer was in flight"
                )
            self.num_posted += 1
        _, base, lkey = self._by_nic[nic]
        return lkey, base

    def release(self, count: int = 1) -> None:
        """`count` work requests acquired earlier completed, or will never execute."""
        with self._cond:
            self.num_posted -= count
            assert self.num_posted >= 0, f"{self.name}: released {count} too many"
            if self.num_posted:
                return
            self._cond.notify_all()
            is_last = self.is_closing and not self._is_waiting and not self.is_closed
            self.is_closed = self.is_closed or is_last
        if is_last:  # NOTE: close()'s wait ended first; the poller closes them
            close_all(self.mrs())

    def close(self, wait_s: float) -> bool:
        """Refuse new work; close the MRs once nothing posted names them, waiting up to
        `wait_s` for that. True: closed now; False: the last release closes them."""
        end = time.monotonic() + wait_s
        with self._cond:
            self.is_closing = self._is_waiting = True
            while self.num_posted and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            self._is_waiting = False
            if self.num_posted or self.is_closed:
                return self.is_closed
            self.is_closed = True
        close_all(self.mrs())
        return True


def close_all(objs: list[Any]) -> None:
    for o in objs:
        try:
            o.close()
        except Exception as e:  # pragma: no cover - device already gone
            log.warning("closing %r: %s", o, e)
