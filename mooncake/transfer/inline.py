"""Moving one small request on the caller's own thread: no Batch, no queue, no hand-off.

A Store's usual get or put is one request of a few KiB, where waking a transport thread
would cost more than the move itself. `move_now` does it at once: a copy when the remote
segment is mapped here (shm, local), else one exchange over an idle tcp connection.
`start_move` splits the tcp exchange in two: the request goes out now and the reply is
taken later, so the caller can do something else meanwhile (the Store asks its master
where a value is while it already reads it from where it was: store/client/client.py).

    mover = InlineMover(check, pathset, peek, options)  # the engine's own (see the class)
    if not mover.move_now(request, timeout): ...   # the general path: engine.transfer()
    finish = mover.start_move(request, timeout)    # None: could not start this way
    ... ; done = finish()                              # True once moved
    ... ; finish(False)                                # or: not wanted after all

Neither raises nor records a failure: a request that does not qualify or does not work
out is left to the general path, which retries and reports (a repeat is harmless: the
same bytes read or written again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mooncake.errors import TransferError
from mooncake.transfer.paths import PathSet
from mooncake.transfer.segment import Region
from mooncake.transfer.tcp import TcpPath, TcpTransport
from mooncake.transfer.transport import Target, copy
from mooncake.transfer.types import EngineOptions, TransferRequest


class Finish(Protocol):
    """Ends a started move: finish() waits (True once moved, False if it failed);
    finish(False) abandons it."""

    def __call__(self, wait: bool = True) -> bool: ...


def _done(wait: bool = True) -> bool:
    return True


class InlineMover:
    """Moves single requests on the caller's thread, with what it needs of the engine:
    `check` (validate a request: its local region and resolved target, or TransferError),
    `pathset` (a target's paths from a local location), `peek` (a target if already
    resolved, never asking anyone) and the engine's options."""

    def __init__(
        self,
        check: Callable[[TransferRequest], tuple[Region, Target]],
        pathset: Callable[[Target, str], PathSet],
        peek: Callable[[str], Target | None],
        options: EngineOptions,
    ):
        self._check = check
        self._pathset = pathset
        self._peek = peek
        self._options = options
        self._io_timeout_s = options.slice_io_timeout_s

    def _plan(
        self, r: TransferRequest, timeout: float | None
    ) -> Callable[[], bool] | tuple[TcpPath, memoryview, int] | None:
        """How `r` can move on this thread: a copy to make (a callable that makes it), a tcp
        path with the local memory and the remote token, or None (the general path)."""
        try:
            local, target = self._check(r)
        except TransferError:
            return None  # the general path raises it, worded for the batch
        transport = target.transport
        if r.length > transport.slice_bytes(self._options) or local.view.mv is None:
            return None  # NOTE: device memory is staged (transfer/staged.py) or goes over rdma
        if target.remote_array is not None and local.array is not None:  # shm, local: a copy
            remote, la = target.remote_array, local.array

            def move() -> bool:
                copy(r.op, la, r.local_offset, remote, r.remote_offset, r.length)
                return True

            return move
        if not isinstance(transport, TcpTransport):
            return None
        if (timeout or self._options.timeout_s) < self._io_timeout_s:
            return None  # as in transfer(): a stalled socket must not outlast the deadline
        pathset = self._pathset(target, local.location)
        path = pathset.paths[0] if len(pathset.paths) == 1 else pathset.first()
        if not isinstance(path, TcpPath):
            return None
        mem = local.view.mv[r.local_offset : r.local_offset + r.length]
        return path, mem, target.desc.token

    def move_now(self, r: TransferRequest, timeout: float | None) -> bool:
        """Move one small tcp, shm or local request on this thread; False when it does not
        qualify or did not work out (nothing is recorded: the general path does it)."""
        plan = self._plan(r, timeout)
        if plan is None:
            return False
        if callable(plan):
            return plan()
        path, mem, token = plan
        return path.move_now(r.op, mem, token, r.remote_offset)

    def start_move(self, r: TransferRequest, timeout: float | None) -> Finish | None:
        """Begin moving one small request on this thread and return what finishes it: with
        wait=True (the default) True once moved, False if it failed; with wait=False it is
        abandoned (a tcp request's connection is closed unread, with no wait for a node that
        may be gone). None if it cannot begin this way: nothing was sent.

        Only to a segment already resolved, with the request's token, and over tcp only on an
        idle connection: never a lookup or a connect, which can take seconds when the node is
        gone. A copy (shm, local) is made at once; over tcp the request is sent now and the
        reply is taken by the returned call, which must be made (it gives the connection back
        or closes it)."""
        known = self._peek(r.remote_segment)
        if known is None or (r.remote_token and known.desc.token != r.remote_token):
            return None
        plan = self._plan(r, timeout)
        if plan is None:
            return None
        if callable(plan):
            return _done if plan() else None
        path, mem, token = plan
        started = path.start_now(r.op, mem, token, r.remote_offset)
        if started is None:
            return None

        def finish(wait: bool = True) -> bool:
            if wait:
                return path.finish_now(started, r.op, mem)
            path.abandon_now(started)
            return False

        return finish
