"""Requests whose local buffer is device memory, over a transport that needs host bytes
(tcp, shm, local): each moves as one slice on a staging thread, its chunks staged through
bounce buffers (transfer/staging.py) and each chunk moved as a host sub-batch over the
target's own paths, with their retries. The request is DONE once its last chunk landed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from mooncake.errors import TransferError
from mooncake.native.memory import buffer_view
from mooncake.transfer.batch import Batch, Slice
from mooncake.transfer.paths import Path, PathSet, cut
from mooncake.transfer.segment import Region
from mooncake.transfer.staging import Stager
from mooncake.transfer.transport import Target
from mooncake.transfer.types import EngineOptions, TransferOp, TransferRequest

log = logging.getLogger(__name__)


class StagePath(Path):
    """Where the engine queues staged requests: a pool of staging threads. It takes from the
    engine only what it uses: `forget` (drop a remote segment's cached resolution),
    `pathset` (a target's paths from a local location) and the engine's options."""

    def __init__(
        self,
        forget: Callable[[str], None],
        pathset: Callable[[Target, str], PathSet],
        options: EngineOptions,
        stager: Stager,
        num_threads: int,
    ):
        super().__init__("staged via pinned host memory", "", "")
        self._forget = forget
        self._pathset = pathset
        self._options = options
        self.stager = stager
        self._num_threads = max(1, num_threads)
        self._pool: ThreadPoolExecutor | None = None

    def add(
        self, batch: Batch, i: int, local: Region, target: Any, by_path: dict[Any, list[Slice]]
    ) -> None:
        """Plan request `i` of `batch` as one staged slice (added to `by_path`)."""
        r = batch.requests[i]
        batch.add_slices(i, 1)
        s = Slice(batch, i, r.op, local, r.local_offset, target, r.remote_offset, r.length)
        s.path = self
        by_path.setdefault(self, []).append(s)

    def dispatch(self, slices: list[Slice]) -> None:
        if self._pool is None:  # NOTE: threads only on a node that stages device memory
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="te-stage")
        for s in slices:
            self._pool.submit(self._run, s)

    def close(self) -> None:
        """Wait for the staged requests under way (their batches end), then stop."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, s: Slice) -> None:
        if not s.batch.is_live(s.index):
            return
        view = s.local.view
        try:
            if s.op is TransferOp.WRITE:
                self.stager.out(view, s.local_offset, s.length, self._mover(s))
            else:
                self.stager.into(view, s.local_offset, s.length, self._mover(s))
        except TransferError as e:
            s.batch.fail(s.index, f"staged through host memory: {e}")
            self._forget(s.batch.requests[s.index].remote_segment)
        except Exception as e:  # a CUDA error: fail this request, keep the thread
            log.exception("staging %r failed", s)
            s.batch.fail(s.index, f"staging device memory failed: {e}")
        else:  # NOTE: the chunks' sub-batches counted the bytes per transport already
            self.record_success(s.length)
            s.batch.slices_done([s])

    def _mover(self, s: Slice) -> Callable[[np.ndarray, int], Callable[[], None]]:
        """Moves one chunk (a bounce buffer at `pos` of the request) as a host sub-batch."""
        r = s.batch.requests[s.index]

        def move(chunk: np.ndarray, pos: int) -> Callable[[], None]:
            if not s.batch.is_live(s.index):
                raise TransferError(s.batch.poll()[s.index].reason or "batch deadline passed")
            part = TransferRequest(
                s.op,
                r.local_segment,
                r.local_offset + pos,
                r.remote_segment,
                s.remote_offset + pos,
                len(chunk),
                r.remote_token,
            )
            sub = Batch([part], s.batch.deadline)
            by_path: dict[Any, list[Slice]] = {}
            local = bounce_region(chunk, s.local.location)
            pathset = self._pathset(s.target, local.location)
            cut(sub, 0, local, 0, s.target, pathset, self._options, by_path)
            for path, slices in by_path.items():
                path.dispatch(slices)

            def wait() -> None:
                sub.check()

            return wait

        return move


def bounce_region(chunk: np.ndarray, location: str) -> Region:
    """A bounce buffer as the local side of host slices (never in the segment table:
    peers cannot address it). Its location is the device's: paths near that GPU."""
    return Region("~staging", 0, buffer_view(chunk, location), chunk)
