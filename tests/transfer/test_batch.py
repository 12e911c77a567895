"""Batch bookkeeping without any I/O: a request is done only when all its slices are,
one failed slice fails its request, the deadline turns pending requests into TIMED_OUT;
adjacent slices form runs (one wire request / one copy); settings come from [transfer]."""

from __future__ import annotations

import threading
import time

from mooncake.config.settings import TransferConfig
from mooncake.transfer import EngineOptions, TransferOp, TransferRequest, TransferState
from mooncake.transfer.batch import Batch, Slice, chunked, contiguous_runs

W = TransferOp.WRITE


def _batch(n: int, deadline_s: float = 60.0) -> Batch:
    reqs = [TransferRequest(W, "l", 0, "r", 0, 10)] * n
    return Batch(reqs, time.monotonic() + deadline_s)


def test_request_is_done_only_when_every_slice_is() -> None:
    b = _batch(2)
    b.add_slices(0, 2)
    b.add_slices(1, 1)
    s0, s1, s2 = (Slice(b, i, W, "L", 0, "T", 0, 5) for i in (0, 0, 1))
    b.slices_done([s0])
    assert [s.state for s in b.poll()] == [TransferState.PENDING] * 2 and not b.is_done
    b.fail(1, "boom")
    b.slices_done([s1, s2])  # s2's request already failed: ignored
    done, failed = b.wait(0)
    assert (done.state, done.bytes_done) == (TransferState.DONE, 10)
    assert (failed.state, failed.reason, failed.bytes_done) == (TransferState.FAILED, "boom", 0)
    assert b.is_done


def test_pending_requests_time_out_at_the_deadline() -> None:
    b = _batch(1, deadline_s=0.0)
    b.add_slices(0, 1)
    assert b.wait(5.0)[0].state is TransferState.TIMED_OUT and not b.is_live(0)


def test_wait_wakes_when_another_thread_finishes_the_last_slice() -> None:
    """wait() blocks (its Event is made on demand) until a worker thread reports the last
    slice, and check() of the ended batch returns its bytes at once."""
    b = _batch(1)
    b.add_slices(0, 1)
    s = Slice(b, 0, W, "L", 0, "T", 0, 10)
    worker = threading.Timer(0.05, b.slices_done, ([s],))
    worker.start()
    assert b.wait(10.0)[0].state is TransferState.DONE and b.num_open == 0
    worker.join()
    assert b.check() == 10


def _s(local_off: int, remote_off: int, n: int, op: TransferOp = W, target: str = "T") -> Slice:
    return Slice(_batch(1), 0, op, "L", local_off, target, remote_off, n)


def test_adjacent_slices_form_runs_and_others_do_not() -> None:
    a, b, c = _s(0, 100, 10), _s(10, 110, 5), _s(15, 200, 5)  # c jumps remotely
    d, e = _s(20, 205, 5, TransferOp.READ), _s(25, 210, 5, target="U")
    assert contiguous_runs([a, b, c, d, e]) == [[a, b], [c], [d], [e]]


def test_chunks_hold_at_most_max_bytes_unless_one_slice_is_bigger() -> None:
    slices = [_s(0, 0, 4), _s(4, 4, 4), _s(8, 8, 20), _s(28, 28, 4)]
    assert [len(c) for c in chunked(slices, 8)] == [2, 1, 1]


def test_options_follow_the_transfer_section() -> None:
    cfg = TransferConfig(
        protocol="tcp", slice_bytes=1 << 20, retry_budget=5, timeout_s=6.0, spin_us=0.0
    )
    opts = EngineOptions.from_config(cfg, copy_threads=1)
    assert (
        opts.protocol,
        opts.slice_bytes,
        opts.retry_budget,
        opts.copy_threads,
        opts.spin_us,
    ) == ("tcp", 1 << 20, 5, 1, 0.0)
    assert opts.slice_io_timeout_s == 1.0  # timeout_s / (retry_budget + 1)
