"""The rdma transport under load on the verbs emulator: flow control keeps every send queue
and completion queue within its depth, a QP put in error mid-batch loses no slice, and
threads posting while QPs reset never use a destroyed QP."""

from __future__ import annotations

import threading
import time

import numpy as np

from mooncake.config.rdma import RdmaConfig
from mooncake.transfer import TransferOp, TransferRequest
from tests.transfer.peer import pattern
from tests.transfer.rdma_helpers import flat_fabric, rdma_pair, transport, wait_for

READ, WRITE = TransferOp.READ, TransferOp.WRITE


def test_256_mib_in_4_kib_slices_over_two_nics_stays_within_queue_depths(emulator) -> None:
    cfg = RdmaConfig(rdma_queue_depth=64, rdma_cq_depth=256)
    n = 256 << 20
    with rdma_pair(cfg, timeout_s=120.0) as (a, b):
        pool = b.allocate("pool", n)
        src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, np.uint8)
        a.register("src", src)
        a.register("dst", dst)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, n)]).check()
        assert np.array_equal(pool, src)
        a.submit([TransferRequest(READ, "dst", 0, "pool", 0, n)]).check()
        assert np.array_equal(dst, src)
        paths = a.resolve("pool").pathsets["cpu:0"].paths
        credits = transport(a).credits
        figures = {
            "slices": n // 4096,
            "max_sq_outstanding": emulator.STATS["max_sq"],
            "sq_depth": emulator.STATS["max_sq_depth"],
            "max_cq_entries": emulator.STATS["max_cq"],
            "cq_depth": emulator.STATS["max_cq_depth"],
            "max_cq_in_use": {k: c.max_used for k, c in credits.items()},
            "overruns": emulator.STATS["overruns"],
            "retries": a.num_retries,
        }
        print("256 MiB figures:", figures)
        assert len(paths) == 4 and all(p.num_slices > 0 for p in paths)
        assert emulator.STATS["max_sq"] <= 64 == emulator.STATS["max_sq_depth"]
        assert emulator.STATS["max_cq"] <= 256 == emulator.STATS["max_cq_depth"]
        assert all(c.max_used <= 256 for c in credits.values())
        assert emulator.STATS["overruns"] == 0 and a.num_retries == 0


def test_flow_control_queues_what_the_send_queues_and_cq_cannot_hold(emulator) -> None:
    flat_fabric()  # any GID reaches any NIC: only queue depths matter here
    n = 64 << 20  # 16,384 work requests: 2,048 per QP, 8,192 per CQ
    with rdma_pair(RdmaConfig(rdma_queue_depth=256, rdma_cq_depth=4096), timeout_s=60.0) as (a, b):
        pool = b.allocate("pool", n)
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        a.register("src", src)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, n)]).check()
        assert np.array_equal(pool, src)
        assert emulator.STATS["overruns"] == 0 and a.num_retries == 0
        assert emulator.STATS["max_sq"] <= 256 and emulator.STATS["max_cq"] <= 4096


def test_qp_forced_into_error_mid_batch_loses_no_slice(emulator) -> None:
    flat_fabric()
    n = 32 << 20
    cfg = RdmaConfig(rdma_queue_depth=32, rdma_cq_depth=128)
    with rdma_pair(cfg, timeout_s=30.0, pause_after_failures=1000) as (a, b):
        pool = b.allocate("pool", n)
        src = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
        a.register("src", src)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 4096)]).check()
        first = {q.gen for _, q in transport(a)._by_gen.values()}
        batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, n)])
        assert wait_for(lambda: batch.poll()[0].bytes_done > n // 4)
        broken = []
        assert wait_for(lambda: bool(broken.extend(emulator.break_qps("fake_0", 2)) or broken))
        batch.check()
        assert np.array_equal(pool, src)
        assert a.num_retries > 0  # the flushed work requests went to other QPs
        assert emulator.STATS["dropped"] == 0  # no QP was destroyed with work on it
        # the broken QPs were destroyed once drained, and their slots connected again
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 20)]).check()
        live = {q.qp.qp_num for _, q in transport(a)._by_gen.values()}
        assert not live & set(broken)
        assert {q.gen for _, q in transport(a)._by_gen.values()} - first


def test_the_work_one_qp_error_flushes_does_not_pause_its_path(emulator) -> None:
    """One QP in error flushes every work request it held: that is one failure of the path,
    not one per flushed request (with the default pause after 3 failures, counting each
    would pause the only path and fail the batch "every other path is paused")."""
    flat_fabric()
    del emulator.DEVICES["fake_1"]  # one NIC: one path, nowhere else to retry
    n = 16 << 20
    cfg = RdmaConfig(rdma_queue_depth=32, rdma_cq_depth=128)
    with rdma_pair(cfg, timeout_s=30.0) as (a, b):
        pool = b.allocate("pool", n)
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        a.register("src", src)
        a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 4096)]).check()
        batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, n)])
        assert wait_for(lambda: batch.poll()[0].bytes_done > n // 4)
        assert wait_for(lambda: bool(emulator.break_qps("fake_0", 1)))
        batch.check()
        assert np.array_equal(pool, src)
        assert a.num_retries > 1  # several flushed requests, each retried


def test_eight_threads_posting_while_qps_reset_never_crash(emulator) -> None:
    flat_fabric()
    size = 1 << 20
    cfg = RdmaConfig(rdma_queue_depth=16, rdma_cq_depth=64)
    opts = {
        "timeout_s": 60.0,
        "io_timeout_s": 5.0,
        "retry_budget": 10_000,
        "pause_after_failures": 10**6,
    }
    with rdma_pair(cfg, **opts) as (a, b):
        pool = b.allocate("pool", 8 * size)
        srcs = [pattern(size, offset=i) for i in range(8)]
        for i, src in enumerate(srcs):
            a.register(f"src{i}", src)
        stop, resets, errors = threading.Event(), [0], []

        def breaker() -> None:
            while not stop.is_set():
                resets[0] += len(emulator.break_qps("fake_0", 1) + emulator.break_qps("fake_1", 1))
                time.sleep(0.002)

        def poster(i: int) -> None:
            try:
                for _ in range(3):
                    req = TransferRequest(WRITE, f"src{i}", 0, "pool", i * size, size)
                    a.submit([req]).check()
            except BaseException as e:  # noqa: BLE001 - a VerbsCrash included
                errors.append(e)

        threads = [threading.Thread(target=poster, args=(i,)) for i in range(8)]
        reset_thread = threading.Thread(target=breaker)
        reset_thread.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        reset_thread.join()
        assert not errors, errors[:3]
        for i, src in enumerate(srcs):
            assert np.array_equal(pool[i * size : (i + 1) * size], src), i
        assert resets[0] > 0
        print(f"8 posting threads: {resets[0]} QPs reset, {a.num_retries} slices retried")
