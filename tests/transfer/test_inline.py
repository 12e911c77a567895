"""TransferEngine.start(): one small request begun on the caller's thread, finished later
(transfer/inline.py). It never looks a segment up nor connects, and a started request
always leaves its connection usable."""

from __future__ import annotations

import numpy as np

from mooncake.transfer import TransferOp, TransferRequest
from tests.transfer.peer import pattern

READ, WRITE = TransferOp.READ, TransferOp.WRITE


def test_start_sends_now_and_the_reply_is_taken_later(engines) -> None:
    a, b = engines
    pool = b.allocate("pool", 1 << 16)
    pool[:] = pattern(1 << 16)
    dst = np.zeros(4096, np.uint8)
    a.register("dst", dst)
    read = TransferRequest(READ, "dst", 0, "pool", 512, 4096)
    # unresolved segment, then no idle connection: nothing is sent, nothing connects
    assert a.start(read) is None
    a.resolve("pool")
    assert a.start(read) is None and not dst.any()
    a.move(read)  # leaves an idle connection behind
    dst[:] = 0
    finish = a.start(read)
    assert finish is not None
    assert a.start(read) is None  # its connection is held until the reply is taken
    assert finish() is True and (dst == pool[512 : 512 + 4096]).all()
    finish = a.start(read)  # the connection went back to the idle ones
    assert finish is not None and finish()


def test_a_refused_start_reports_false_and_the_next_move_reconnects(engines) -> None:
    a, b = engines
    b.allocate("pool", 1 << 16)
    a.register("dst", np.zeros(8192, np.uint8))
    a.move(TransferRequest(READ, "dst", 0, "pool", 0, 4096))
    token = a.resolve("pool").desc.token
    b.unregister("pool")  # the node refuses the token from now on
    b.allocate("other", 1 << 16)
    finish = a.start(TransferRequest(READ, "dst", 0, "pool", 0, 4096, token))
    assert finish is not None and finish() is False
    a.move(TransferRequest(READ, "dst", 0, "other", 0, 4096))  # a new connection works


def test_start_with_a_stale_token_sends_nothing(engines) -> None:
    a, b = engines
    b.allocate("pool", 1 << 16)
    a.register("dst", np.zeros(4096, np.uint8))
    a.move(TransferRequest(READ, "dst", 0, "pool", 0, 4096))
    stale = a.resolve("pool").desc.token + 1
    assert a.start(TransferRequest(READ, "dst", 0, "pool", 0, 4096, stale)) is None


def test_a_shm_start_is_a_copy_made_at_once() -> None:
    from tests.transfer.conftest import make_engine

    a, b = make_engine("a", protocol="shm"), make_engine("b", protocol="shm")
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        pool = b.allocate("pool", 8192)
        pool[:] = pattern(8192)
        dst = np.zeros(4096, np.uint8)
        a.register("dst", dst)
        a.resolve("pool")
        finish = a.start(TransferRequest(READ, "dst", 0, "pool", 4096, 4096))
        assert finish is not None and (dst == pool[4096:]).all()  # before finish()
        assert finish() is True
    finally:
        a.close()
        b.close()


def test_an_abandoned_start_closes_its_connection_unread(engines) -> None:
    """finish(False): the reply is never waited for (the node may be gone); the connection
    is closed, so no stale reply is ever taken for a later request."""
    a, b = engines
    pool = b.allocate("pool", 1 << 16)
    pool[:] = pattern(1 << 16)
    dst = np.zeros(4096, np.uint8)
    a.register("dst", dst)
    a.move(TransferRequest(READ, "dst", 0, "pool", 0, 4096))
    finish = a.start(TransferRequest(READ, "dst", 0, "pool", 8192, 4096))
    assert finish is not None and finish(False) is False
    assert a.start(TransferRequest(READ, "dst", 0, "pool", 0, 4096)) is None  # none idle
    a.move(TransferRequest(READ, "dst", 0, "pool", 4096, 4096))  # a new connection
    assert (dst == pool[4096:8192]).all()


def test_segments_come_and_go_while_transfers_run(engines) -> None:
    """The server's segment table changes (register, unregister) while four threads move
    bytes to and from another segment: every transfer completes byte for byte, and a
    removed segment is refused (native/dataloop.py's lock; the Python loop alike)."""
    import threading

    from mooncake.errors import TransferError

    a, b = engines
    pool = b.allocate("pool", 1 << 20)
    errors: list[str] = []
    stop = threading.Event()
    registered = threading.Barrier(5)  # NOTE: the main thread moves src0/dst0 too

    def mover(k: int) -> None:
        src, dst = pattern(8192) ^ k, np.zeros(8192, np.uint8)
        a.register(f"src{k}", src)
        a.register(f"dst{k}", dst)
        registered.wait(10)
        while not stop.is_set():
            a.move(TransferRequest(WRITE, f"src{k}", 0, "pool", k * 8192, 8192))
            a.move(TransferRequest(READ, f"dst{k}", 0, "pool", k * 8192, 8192))
            if not (dst == src).all():
                errors.append(f"thread {k} read back other bytes")

    threads = [threading.Thread(target=mover, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    registered.wait(10)
    try:
        for i in range(30):
            b.allocate(f"extra{i}", 4096)
            a.move(TransferRequest(WRITE, "src0", 0, f"extra{i}", 0, 4096))
            b.unregister(f"extra{i}")
            try:
                a.move(TransferRequest(READ, "dst0", 0, f"extra{i}", 0, 4096), 2.0)
                errors.append(f"extra{i} was served after it was unregistered")
            except TransferError:
                pass
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert errors == [] and pool.any()
