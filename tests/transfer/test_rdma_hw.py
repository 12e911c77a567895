"""The rdma transport on a real RDMA node (marker `rdma`; skipped without pyverbs or a
device): two engines of this process talk through the node's own NICs, so every path,
GID, MTU and queue depth is the hardware's. Run: pytest -m rdma tests/transfer/test_rdma_hw.py
"""

from __future__ import annotations

import os
import resource
import threading

import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.native import rdma
from mooncake.transfer import EngineOptions, TransferEngine, TransferOp, TransferRequest
from tests.transfer.conftest import SECRET

pytestmark = pytest.mark.rdma
try:
    VERBS = rdma.load_pyverbs()
    DEVICES = rdma.list_devices(VERBS)
except ImportError:  # pragma: no cover - depends on the host
    VERBS, DEVICES = None, []
if not DEVICES:
    pytest.skip("no RDMA device (or no pyverbs) on this host", allow_module_level=True)


@pytest.fixture
def pair():  # pragma: no cover - RDMA hardware
    # NOTE: a node may have one NIC (one path): flushed slices must not pause it here
    opts = EngineOptions(
        protocol="rdma", timeout_s=60.0, retry_budget=100, pause_after_failures=10**6
    )
    a, b = TransferEngine("hw-a", SECRET, opts), TransferEngine("hw-b", SECRET, opts)
    a.directory.add_peer("127.0.0.1", b.server.port)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("size", [64 << 10, 1 << 20, 16 << 20, 256 << 20])
def test_write_and_read_through_the_nics_byte_for_byte(pair, size):  # pragma: no cover
    a, b = pair
    pool = b.allocate("pool", size)
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    a.register("src", src)
    a.register("dst", dst)
    a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, size)]).check()
    assert np.array_equal(pool, src)
    a.submit([TransferRequest(TransferOp.READ, "dst", 0, "pool", 0, size)]).check()
    assert np.array_equal(dst, src)
    assert a.num_retries == 0
    for nic in a._transports["rdma"].nics.values():
        print(nic.name, nic.port, nic.limits, nic.queue_depth, nic.cq_depth)


def test_a_qp_put_in_error_mid_batch_loses_no_slice(pair):  # pragma: no cover
    a, b = pair
    size = 256 << 20
    pool = b.allocate("pool", size)
    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    a.register("src", src)
    a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, 4096)]).check()
    t = a._transports["rdma"]
    batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, size)])
    path, q = next(iter(t._by_gen.values()))
    with path.lock:
        path._to_error(q)  # ibv_modify_qp(ERR): its work flushes and is retried elsewhere
    batch.check()
    assert np.array_equal(pool, src)


def test_pinning_past_rlimit_memlock_names_ulimit(pair):  # pragma: no cover
    if os.geteuid() == 0:
        pytest.skip("root pins without limit (CAP_IPC_LOCK)")
    a, _ = pair
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    try:
        with pytest.raises(TransferError, match="ulimit -l"):
            a.register("big", np.zeros(64 << 20, np.uint8))
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_eight_threads_while_qps_are_put_in_error(pair):  # pragma: no cover
    a, b = pair
    size = 8 << 20
    pool = b.allocate("pool", 8 * size)
    srcs = [np.full(size, i + 1, np.uint8) for i in range(8)]
    for i, s in enumerate(srcs):
        a.register(f"s{i}", s)
    t, stop, errors = a._transports["rdma"], threading.Event(), []

    def breaker():
        while not stop.wait(0.01):
            for path, q in list(t._by_gen.values())[:1]:
                with path.lock:
                    path._to_error(q)

    def poster(i):
        try:
            for _ in range(5):
                req = TransferRequest(TransferOp.WRITE, f"s{i}", 0, "pool", i * size, size)
                a.submit([req]).check()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=poster, args=(i,)) for i in range(8)]
    breaking = threading.Thread(target=breaker)
    breaking.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    breaking.join()
    assert not errors, errors[:3]
    assert all((pool[i * size : (i + 1) * size] == i + 1).all() for i in range(8))


def test_unregistering_a_segment_in_flight_on_the_nic(pair):  # pragma: no cover
    """The race of issue 35's first defect on real verbs: the request fails naming the
    segment, no poller dies (a closed MR's key would be a NULL dereference here), and the
    NICs carry later transfers."""
    a, b = pair
    size = 64 << 20
    pool = b.allocate("pool", size)
    src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    for _ in range(5):
        a.register("src", src)
        batch = a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, size)])
        a.unregister("src")
        status = batch.wait(60.0)[0]
        assert status.state.value in ("failed", "done"), status  # done: it won the race
    t = a._transports["rdma"]
    assert all(p.is_alive() for p in t._pollers) and t.num_poller_errors == 0
    a.register("src", src)
    a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, size)]).check()
    assert np.array_equal(pool, src)


def test_a_restarted_initiator_is_never_refused_by_the_qp_quota(pair):  # pragma: no cover
    """Issue 35's second defect on real verbs: initiators restarted under one name, each
    leaving its queue pairs behind, keep connecting; the responder's QPs stay bounded."""
    _, b = pair
    b.allocate("pool", 1 << 20)
    opts = EngineOptions(protocol="rdma", timeout_s=60.0)
    quota = opts.rdma.rdma_max_qps_per_peer
    for _ in range(quota + 2):  # more restarts than the quota has queue pairs
        a = TransferEngine("hw-restarting", SECRET, opts)
        try:
            a.directory.add_peer("127.0.0.1", b.server.port)
            a.register("src", np.ones(4096, np.uint8))
            a.submit([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, 4096)]).check()
        finally:
            a.close()
    served = b._transports["rdma"]._served
    assert sum(1 for key in served if key[0] == "hw-restarting") <= quota
