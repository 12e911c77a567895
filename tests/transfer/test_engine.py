"""TransferEngine in one process: registration, batches over tcp/shm/local, validation that
rejects bad requests before anything moves, statuses, cancel and timeouts."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.transfer import StaticDirectory, TransferOp, TransferRequest, TransferState
from tests.transfer.conftest import make_engine
from tests.transfer.peer import pattern

READ, WRITE = TransferOp.READ, TransferOp.WRITE


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_write_then_read_back_moves_exact_bytes(protocol: str) -> None:
    a, b = make_engine("a", protocol=protocol), make_engine("b", protocol=protocol)
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        pool = b.allocate("pool", 100_000)
        src = pattern(50_000)
        a.register("src", src)
        dst = np.zeros(50_000, np.uint8)
        a.register("dst", dst)
        # odd sizes and offsets: 8 KiB slices with a short tail, several requests
        reqs = [
            TransferRequest(WRITE, "src", off, "pool", 777 + off, n)
            for off, n in [(0, 10_001), (10_001, 1), (10_002, 39_998)]
        ]
        batch = a.submit(reqs)
        assert batch.check(5.0) == 50_000
        assert [s.bytes_done for s in batch.poll()] == [10_001, 1, 39_998]
        assert (pool[777 : 777 + 50_000] == src).all() and not pool[:777].any()
        assert a.submit([TransferRequest(READ, "dst", 0, "pool", 777, 50_000)]).check(5.0)
        assert (dst == src).all()
        assert a.resolve("pool").transport.name == protocol
    finally:
        a.close()
        b.close()


def test_segment_of_the_same_engine_is_a_local_copy() -> None:
    with make_engine("solo") as e:
        src, dst = pattern(10_000), np.zeros(10_000, np.uint8)
        e.register("src", src)
        e.register("dst", dst)
        e.submit([TransferRequest(READ, "dst", 0, "src", 0, 10_000)]).check(5.0)
        assert (dst == src).all() and e.resolve("src").transport.name == "local"


def test_qualified_name_resolves_without_a_known_peer(engines) -> None:
    a, b = engines
    b.register("seg", pattern(8192))
    dst = np.zeros(8192, np.uint8)
    a.register("dst", dst)
    name = f"seg@127.0.0.1:{b.server.port}"
    a.submit([TransferRequest(READ, "dst", 0, name, 0, 8192)]).check(5.0)
    assert (dst == pattern(8192)).all()


def test_static_directory_serves_published_descriptors() -> None:
    shared = StaticDirectory()
    a = make_engine("a", protocol="tcp")
    b = make_engine("b", protocol="tcp")
    a.directory = b.directory = shared
    try:
        b.register("seg", pattern(4096))
        assert a.resolve("seg").desc.node == "b"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("req", "why"),
    [
        (TransferRequest(WRITE, "nope", 0, "pool", 0, 10), "not registered here"),
        (TransferRequest(WRITE, "src", 0, "missing", 0, 10), "no node has segment"),
        (TransferRequest(WRITE, "src", 4090, "pool", 0, 10), "outside segment 'src'"),
        (TransferRequest(WRITE, "src", 0, "pool", 8190, 10), "outside segment 'pool'"),
        (TransferRequest(WRITE, "src", 0, "pool", -1, 10), "outside segment 'pool'"),
        (TransferRequest(READ, "src", 0, "pool", 0, 0), "length must be > 0"),
    ],
)
def test_bad_request_rejects_the_whole_batch_and_writes_nothing(engines, req, why) -> None:
    a, b = engines
    pool = b.allocate("pool", 8192)
    a.register("src", pattern(4096))
    good = TransferRequest(WRITE, "src", 0, "pool", 0, 4096)
    with pytest.raises(TransferError, match=why):
        a.submit([good, req])
    assert not pool.any()


def test_register_refuses_duplicates_and_bad_names(engines) -> None:
    a, _ = engines
    a.register("x", np.zeros(8, np.uint8))
    with pytest.raises(TransferError, match="already registered"):
        a.register("x", np.zeros(8, np.uint8))
    with pytest.raises(TransferError, match="invalid segment name"):
        a.register("x@host:1", np.zeros(8, np.uint8))
    with pytest.raises(TransferError, match="read-only"):
        a.register("ro", b"bytes")


def test_reregistered_segment_fails_stale_requests_then_resolves_anew(engines) -> None:
    a, b = engines
    b.register("seg", np.zeros(8192, np.uint8))
    a.register("src", pattern(4096))
    req = TransferRequest(WRITE, "src", 0, "seg", 0, 4096)
    a.submit([req]).check(5.0)
    b.unregister("seg")
    fresh = np.zeros(8192, np.uint8)
    b.register("seg", fresh)  # new token: the cached descriptor is stale
    status = a.submit([req]).wait(5.0)[0]
    assert status.state is TransferState.FAILED and "no such segment" in status.reason
    a.submit([req]).check(5.0)  # the failure dropped the cache; this resolves the new one
    assert (fresh[:4096] == pattern(4096)).all()


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_request_with_a_stale_token_never_reaches_the_new_registration(protocol: str) -> None:
    """A request naming the token its offsets came with is refused once the segment was
    registered again, even after the initiator resolved the new registration; without a
    token it reaches the new one."""
    a, b = make_engine("a", protocol=protocol), make_engine("b", protocol=protocol)
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        b.allocate("seg", 8192)  # shm-backed, so both transports reach it
        old = b.describe("seg").token  # type: ignore[union-attr]
        a.register("src", pattern(4096))
        a.transfer([TransferRequest(WRITE, "src", 0, "seg", 0, 4096, old)]).check()
        b.unregister("seg")
        fresh = b.allocate("seg", 8192)
        new = b.describe("seg").token  # type: ignore[union-attr]
        a.forget("seg")
        assert a.resolve("seg").desc.token == new
        with pytest.raises(TransferError, match="registered again"):
            a.transfer([TransferRequest(WRITE, "src", 0, "seg", 0, 4096, old)])
        assert not fresh.any()
        a.transfer([TransferRequest(WRITE, "src", 0, "seg", 0, 4096, new)]).check()
        assert (fresh[:4096] == pattern(4096)).all()
    finally:
        a.close()
        b.close()


def test_cancel_marks_pending_requests_cancelled(engines) -> None:
    a, b = engines
    b.allocate("pool", 1 << 20)
    a.register("src", np.zeros(1 << 20, np.uint8))
    batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 20)] * 4)
    batch.cancel()
    states = {s.state for s in batch.wait(5.0)}
    assert states <= {TransferState.CANCELLED, TransferState.DONE} and batch.is_done


def test_empty_batch_is_done_at_once(engines) -> None:
    a, _ = engines
    assert a.submit([]).wait(0) == [] and a.submit([]).is_done


def test_short_cluster_secret_is_refused() -> None:
    from mooncake.errors import ConfigError
    from mooncake.transfer import TransferEngine

    with pytest.raises(ConfigError, match="at least 16 bytes"):
        TransferEngine("x", "short")


@pytest.mark.parametrize("size", [1, 4096, 50_000])
def test_transfer_moves_exact_bytes_and_returns_an_ended_batch(engines, size: int) -> None:
    """transfer() (the calling thread moves the first group itself, the rest goes to the
    workers) writes and reads back the same bytes as submit(), and returns only once
    every request ended."""
    a, b = engines
    pool = b.allocate("pool", 100_000)
    src, dst = pattern(size), np.zeros(size, np.uint8)
    a.register("src", src)
    a.register("dst", dst)
    batch = a.transfer([TransferRequest(WRITE, "src", 0, "pool", 333, size)])
    assert batch.is_done and batch.check(0) == size
    assert (pool[333 : 333 + size] == src).all() and not pool[:333].any()
    assert a.transfer([TransferRequest(READ, "dst", 0, "pool", 333, size)]).check(0) == size
    assert (dst == src).all()


def test_transfer_rejects_bad_requests_as_submit_does(engines) -> None:
    a, b = engines
    pool = b.allocate("pool", 8192)
    a.register("src", pattern(4096))
    with pytest.raises(TransferError, match="outside segment 'pool'"):
        a.transfer([TransferRequest(WRITE, "src", 0, "pool", 8000, 4096)])
    assert not pool.any()


def test_transfer_reports_a_refused_request_as_failed(engines) -> None:
    """A request the peer refuses (its segment was re-registered) fails, it never hangs."""
    a, b = engines
    b.register("seg", np.zeros(8192, np.uint8))
    a.register("src", pattern(4096))
    req = TransferRequest(WRITE, "src", 0, "seg", 0, 4096)
    a.transfer([req]).check(5.0)
    b.unregister("seg")
    b.register("seg", np.zeros(8192, np.uint8))
    status = a.transfer([req]).poll()[0]
    assert status.state is TransferState.FAILED and "no such segment" in status.reason


@pytest.mark.parametrize("protocol", ["shm", "local"])
def test_a_small_copy_runs_on_the_calling_thread(protocol: str) -> None:
    """transfer() of one request up to a slice, to a shm or local segment, is copied by the
    caller (no copy-thread hand-off): it completes with the copy threads unable to take
    work, byte for byte, while a submit() does go to them."""
    a = make_engine("a", protocol="shm")
    b = a if protocol == "local" else make_engine("b", protocol="shm")
    try:
        if b is not a:
            a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        pool = b.allocate("pool", 1 << 20)
        src, dst = pattern(4096), np.zeros(4096, np.uint8)
        a.register("src", src)
        a.register("dst", dst)
        handed: list[object] = []
        a._pool.put = lambda slices, path: handed.append(slices)  # type: ignore[method-assign]
        a.transfer([TransferRequest(WRITE, "src", 0, "pool", 100, 4096)], 2.0).check()
        a.transfer([TransferRequest(READ, "dst", 0, "pool", 100, 4096)], 2.0).check()
        assert handed == [] and (pool[100:4196] == src).all() and (dst == src).all()
        assert a.resolve("pool").transport.name == protocol
        a.submit([TransferRequest(READ, "dst", 0, "pool", 0, 4096)])
        assert len(handed) == 1  # the asynchronous form stays on the copy threads
    finally:
        a.close()
        if b is not a:
            b.close()


def test_move_waits_for_one_request_and_raises_when_it_fails(engines) -> None:
    """move(): one request moved and waited for (on the caller's thread when small, through
    the workers when larger than a slice); a bad or failed request raises TransferError."""
    a, b = engines
    pool = b.allocate("pool", 4 << 20)
    src = pattern(3 << 20)
    a.register("src", src)
    a.move(TransferRequest(WRITE, "src", 0, "pool", 10, 4096))
    a.move(TransferRequest(WRITE, "src", 0, "pool", 1 << 20, 3 << 20), 5.0)  # > one slice
    assert (pool[10:4106] == src[:4096]).all() and (pool[1 << 20 :] == src).all()
    with pytest.raises(TransferError, match="outside segment 'pool'"):
        a.move(TransferRequest(WRITE, "src", 0, "pool", (4 << 20) - 10, 4096))
    b.unregister("pool")
    with pytest.raises(TransferError):
        a.move(TransferRequest(READ, "src", 0, "pool", 0, 4096), 2.0)
