"""The RdmaTransport over the C data loop (transfer/rdmaloop.py): engine pairs in this
process, discovery on the verbs emulator (tests/transfer/fake_verbs.py: ports, GIDs,
limits of fake_0 and fake_1), the data plane in C over the strict fake provider
(tests/transfer/fake_rdma.c: chains, send_flags, dead keys, QP errors). Every test checks
that nothing did what crashes hardware (the fake's fatal count)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import ConfigError
from mooncake.transfer import EngineOptions, TransferEngine, TransferOp, TransferRequest
from mooncake.transfer.types import TransferState
from tests.transfer import fake_verbs
from tests.transfer.conftest import SECRET
from tests.transfer.peer import pattern
from tests.transfer.rdma_helpers import rdma_engine, rdma_pair, transport, wait_for
from tests.transfer.rdmaloop_helpers import IBV_WC_RETRY_EXC_ERR, build_fake, fake_library

READ, WRITE = TransferOp.READ, TransferOp.WRITE
pytestmark = pytest.mark.skipif(bool(build_fake()), reason=build_fake() or "built")


def loop_rdma(max_qps: int = 256) -> RdmaConfig:
    return RdmaConfig(rdma_data_loop="c", rdma_queue_depth=64, rdma_max_qps_per_peer=max_qps)


def loop_engine(name: str, max_qps: int = 256, **options: Any) -> TransferEngine:
    """protocol rdma with rdma_data_loop "c" on the fake provider: 4 KiB slices, 2 QPs per
    path of 64 send slots."""
    provider = fake_library().fake_provider()
    return rdma_engine(name, loop_rdma(max_qps), timeout_s=5.0, rdma_provider=provider, **options)


@pytest.fixture
def fake(emulator: Any) -> Iterator[Any]:
    lib = fake_library()
    lib.fake_hold(0)
    before = lib.fake_num_fatal()
    yield lib
    lib.fake_hold(0)
    assert lib.fake_num_fatal() == before, lib.fake_last_fatal().decode()


@pytest.fixture
def pair(fake: Any) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    cfg = loop_rdma()
    with rdma_pair(cfg, cfg, timeout_s=5.0, rdma_provider=fake.fake_provider()) as (a, b):
        yield a, b


def _qps(engine: TransferEngine) -> list[Any]:
    return [q for p in transport(engine)._paths.values() for q in p.slots if q is not None]


def _connected(a: TransferEngine, b: TransferEngine, offset: int) -> tuple[Any, Any]:
    """b's 1 MiB "pool" and a's "src" (a pattern), a's QPs connected by a first write."""
    pool = b.allocate("pool", 1 << 20)
    src = pattern(1 << 20, offset=offset)
    a.register("src", src)
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 4096)]).check(5.0)
    return pool, src


def test_write_and_read_byte_for_byte_over_2x2_nics_large_and_many_small(pair) -> None:
    a, b = pair
    assert transport(a).data_loop == "c" and transport(b).data_loop == "c"
    pool = b.allocate("pool", 1 << 22)
    src, dst = pattern(1 << 22, offset=5), np.zeros(1 << 22, np.uint8)
    a.register("src", src)
    a.register("dst", dst)
    assert [k.nic for k in a.resolve("pool").desc.rdma] == ["fake_0", "fake_1"]
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 22)]).check(5.0)  # 1024 slices
    assert (pool == src).all()
    a.submit([TransferRequest(READ, "dst", 0, "pool", 0, 1 << 22)]).check(5.0)
    assert (dst == src).all()
    # many small requests at scattered offsets, both ops in one batch
    rng = np.random.default_rng(3)
    offsets = rng.choice((1 << 22) // 1024, 512, replace=False) * 1024
    pool[:] = 0
    writes = [TransferRequest(WRITE, "src", int(o), "pool", int(o), 1000) for o in offsets[:256]]
    reads = [TransferRequest(READ, "dst", int(o), "pool", int(o), 1000) for o in offsets[256:]]
    dst[:] = 0
    a.submit(writes + reads).check(5.0)
    for o in offsets[:256]:
        assert (pool[o : o + 1000] == src[o : o + 1000]).all()
    for o in offsets[256:]:
        assert (dst[o : o + 1000] == 0).all()  # the pool was zeroed before
    paths = a.resolve("pool").pathsets["cpu:0"].paths
    assert len(paths) == 4 and all(p.num_slices > 0 for p in paths)
    assert len(_qps(a)) == 8
    stats = transport(a).loop.stats().counters
    assert stats["work_requests"] >= 2048 + 256 and stats["signalled"] < stats["work_requests"]
    assert a.bytes_by_transport()["rdma"] == 2 * (1 << 22) + 512 * 1000


def test_a_qp_forced_into_error_mid_batch_loses_no_slice(pair) -> None:
    a, b = pair
    fake = fake_library()
    pool, src = _connected(a, b, 9)
    victim = _qps(a)[0]
    assert fake.fake_fail_qp(victim.qp_num, 7, IBV_WC_RETRY_EXC_ERR) == 0
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 20)]).check(5.0)
    assert (pool == src).all()
    assert a.num_retries > 0
    assert transport(a).loop.qp_state(victim.handle) in ("failed", "destroyed")
    pool[:] = 0  # the failed QP's slot is connected again; everything still lands
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 20)]).check(5.0)
    assert (pool == src).all()
    assert victim not in _qps(a)
    assert wait_for(lambda: len(_qps(a)) == 8, 5.0)  # connected again, on a worker


def test_unregister_with_transfers_in_flight_fails_them_cleanly(fake: Any) -> None:
    b = loop_engine("b")
    a = loop_engine("a", io_timeout_s=0.2)
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        pool = b.allocate("pool", 1 << 20)
        src = pattern(1 << 16, offset=1)
        a.register("src", src)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 4096)]).check(5.0)  # connects
        fake.fake_hold(1)  # the device executes nothing: the batch stays in flight
        qps = _qps(a)
        for q in qps:  # every QP's next request fails: every slice is retried, after...
            fake.fake_fail_qp(q.qp_num, 0, IBV_WC_RETRY_EXC_ERR)
        batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)])
        a.unregister("src")  # ...this: C refuses the retries (BAD_REGION), not posted
        fake.fake_hold(0)
        statuses = batch.wait(5.0)
        for q in qps:  # NOTE: a QP the batch left idle would fail its next request
            fake.fake_fail_qp(q.qp_num, -1, 0)
        assert statuses[0].state is TransferState.FAILED
        assert "unregistered while the transfer was in flight" in statuses[0].reason
        assert "src" not in a.segments.names()
        # later transfers work, on new QPs
        again = pattern(1 << 16, offset=2)
        a.register("again", again)
        a.submit([TransferRequest(WRITE, "again", 0, "pool", 0, 1 << 16)]).check(5.0)
        assert (pool[: 1 << 16] == again).all()
    finally:
        fake.fake_hold(0)
        a.close()
        b.close()


def test_a_restarted_initiator_is_not_refused_by_the_qp_quota(fake: Any) -> None:
    b = loop_engine("b", max_qps=8)  # one initiator's 2x2 paths x 2 QPs
    pool = b.allocate("pool", 1 << 16)
    try:
        for k in range(3):
            a = loop_engine("a")
            try:
                a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
                src = pattern(1 << 16, offset=k)
                a.register("src", src)
                a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check(5.0)
                assert (pool == src).all()
            finally:
                a.close()
        served = transport(b)._served
        assert len(served) == 8
        assert all(transport(b).loop.qp_state(sq.qp.handle) == "ready" for sq in served.values())
    finally:
        b.close()


def test_python_serves_when_the_loop_is_off_and_says_so(fake: Any, monkeypatch, caplog) -> None:
    monkeypatch.setenv("MOONCAKE_NATIVE_RDMALOOP", "0")
    caplog.set_level(logging.INFO, logger="mooncake.transfer.rdma")
    rdma = RdmaConfig(rdma_data_loop="auto")
    e = TransferEngine("x", SECRET, EngineOptions(protocol="rdma", rdma=rdma), verbs=fake_verbs)
    try:
        assert transport(e).data_loop == "python"
    finally:
        e.close()
    assert "Python data path" in caplog.text and "MOONCAKE_NATIVE_RDMALOOP=0" in caplog.text
    with pytest.raises(ConfigError, match="MOONCAKE_NATIVE_RDMALOOP=0"):
        loop_engine("y")


def test_auto_falls_back_to_python_when_the_provider_opens_no_nic(fake: Any, caplog) -> None:
    """auto with libibverbs on a host without these devices: pyverbs' emulated NICs serve."""
    caplog.set_level(logging.INFO, logger="mooncake.transfer.rdma")
    rdma = RdmaConfig(rdma_data_loop="auto")
    e = TransferEngine("x", SECRET, EngineOptions(protocol="rdma", rdma=rdma), verbs=fake_verbs)
    try:
        assert transport(e).data_loop == "python"
        assert wait_for(lambda: "does not serve" in caplog.text, 1.0)
    finally:
        e.close()


def test_threads_submitting_while_qps_fail_lose_no_request(pair) -> None:
    """4 threads submit batches of small and large requests while QPs keep failing: every
    request lands byte for byte (retried on other QPs and paths), nothing crashes."""
    a, b = pair
    fake = fake_library()
    pool, src = _connected(a, b, 11)
    errors: list[BaseException] = []

    def submitter(k: int) -> None:
        base = k * (1 << 18)
        try:
            for _ in range(12):
                small = [
                    TransferRequest(WRITE, "src", base + o, "pool", base + o, 3000)
                    for o in range(0, 1 << 17, 4096)
                ]
                large = TransferRequest(
                    WRITE, "src", base + (1 << 17), "pool", base + (1 << 17), 1 << 17
                )
                a.submit([*small, large]).check(5.0)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for n in range(6):  # a QP fails a few requests from now, again and again
        qps = _qps(a)
        if qps:
            fake.fake_fail_qp(qps[n % len(qps)].qp_num, 3, IBV_WC_RETRY_EXC_ERR)
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for k in range(4):
        base = k * (1 << 18)
        for o in range(0, 1 << 17, 4096):
            assert (pool[base + o : base + o + 3000] == src[base + o : base + o + 3000]).all()
        end = base + (1 << 18)
        assert (pool[base + (1 << 17) : end] == src[base + (1 << 17) : end]).all()
    for q in _qps(a):  # NOTE: a QP that never reached its failing request keeps it armed
        fake.fake_fail_qp(q.qp_num, -1, 0)
