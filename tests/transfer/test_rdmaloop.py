"""The RDMA C data loop (native/_rdmaloop.c) over the strict fake provider (fake_rdma.c):
bytes, chains and selective signalling, send-queue room, a QP failing mid-batch, closed
regions, threads; and the stub provider the bench measures. Skipped when the extension was
not built."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.native import rdmaloop
from mooncake.native.rdmaloop import OP_READ, OP_WRITE, Paths, RdmaLoop, Requests
from tests.transfer.rdmaloop_helpers import (
    IBV_WC_RETRY_EXC_ERR,
    ZERO_GID,
    LoopPair,
    address,
    build_fake,
    fake_library,
    fake_stats,
    loop_pair,
)

KIB = 1024
build_fake()  # NOTE: at import, so no test counts as starting a process


@pytest.fixture
def pair():
    p = loop_pair()
    fatal_before = p.fake.fake_num_fatal()
    yield p
    p.close()
    assert p.fake.fake_num_fatal() == fatal_before, p.fake.fake_last_fatal().decode()


def _buffers(p: LoopPair, num_bytes: int, seed: int = 0):
    src = np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)
    dst = np.zeros(num_bytes, np.uint8)
    return src, dst, p.a.register(address(src), num_bytes), p.b.register(address(dst), num_bytes)


def test_write_then_read_move_every_byte_over_2x2_nics():
    """Requests of odd sizes in 4 KiB slices over 2x2 NIC pairs x 2 QPs, written to the
    target and read back into a third buffer, arrive byte for byte."""
    p = loop_pair()
    try:
        size = 4 << 20
        src, dst, local, remote = _buffers(p, size)
        back = np.zeros(size, np.uint8)
        back_region = p.a.register(address(back), size)
        cuts = [0, 1, 4095, 4096, 70_000, 1 << 20, 3_000_001, size]
        n = len(cuts) - 1
        offs, lens = cuts[:-1], [cuts[i + 1] - cuts[i] for i in range(n)]
        write = Requests.of([OP_WRITE] * n, [local.handle] * n, offs, offs, lens)
        result = p.a.transfer(write, p.paths(remote), 4 * KIB, timeout_s=30)
        assert result.is_ok and np.array_equal(src, dst)
        read = Requests.of([OP_READ] * n, [back_region.handle] * n, offs, offs, lens)
        assert p.a.transfer(read, p.paths(remote), 4 * KIB, timeout_s=30).is_ok
        assert np.array_equal(src, back)
        stats = p.a.stats().counters
        assert stats["work_requests"] == 2 * sum(-(-n // (4 * KIB)) for n in lens)
        assert stats["post_errors"] == 0 and stats["stale_completions"] == 0
        assert p.fake.fake_num_fatal() == 0, p.fake.fake_last_fatal()
    finally:
        p.close()


def test_chains_are_signalled_every_nth_and_on_the_last(pair: LoopPair):
    """One QP, signal every 4th, chains of up to 16: completions are a quarter of the work
    requests (plus a chain's short tail), each chain one post_send."""
    src, _, local, remote = _buffers(pair, 1 << 20)
    before = fake_stats(pair.fake)
    qp = pair.qps[0][0]
    req = Requests.of([OP_WRITE], [local.handle], [0], [0], [1 << 20])
    assert pair.a.transfer(req, pair.paths(remote, [qp]), 4 * KIB, timeout_s=10).is_ok
    after = fake_stats(pair.fake)
    num_wrs = after["work_requests"] - before["work_requests"]
    completions = after["completions"] - before["completions"]
    posts = after["post_calls"] - before["post_calls"]
    assert num_wrs == 256
    assert completions == pair.a.stats().counters["signalled"]
    assert num_wrs / 4 <= completions <= num_wrs / 4 + posts  # every 4th, and each chain's last
    assert posts <= num_wrs / 4  # chains of 4 to 16, never one request per call


def test_send_queue_room_is_respected():
    """A send queue of 8 and 1000 slices: never more than 8 outstanding, no refusal."""
    p = loop_pair(num_nics=1, qps_per_path=1, depth=8, signal_every=3, max_chain=32)
    try:
        src, dst, local, remote = _buffers(p, 1000 * KIB)
        req = Requests.of([OP_WRITE], [local.handle], [0], [0], [1000 * KIB])
        assert p.a.transfer(req, p.paths(remote), KIB, timeout_s=10).is_ok
        assert np.array_equal(src, dst)
        assert fake_stats(p.fake)["max_sq_used"] <= 64  # the fake's peak over this session
        assert p.a.stats().counters["post_errors"] == 0
        assert p.fake.fake_num_fatal() == 0, p.fake.fake_last_fatal()
    finally:
        p.close()


def test_a_qp_forced_into_error_mid_batch_loses_no_slice(pair: LoopPair):
    """QP 0 fails at its 6th request: its in-flight slices are reported (its handle, the
    error or a flush), the rest go to the other QPs; retried, every byte arrives."""
    size = 2 << 20
    src, dst, local, remote = _buffers(pair, size)
    bad = pair.qps[0][0]
    pair.fake.fake_fail_qp(pair.qpns[bad], 5, IBV_WC_RETRY_EXC_ERR)
    req = Requests.of([OP_WRITE], [local.handle], [0], [0], [size])
    result = pair.a.transfer(req, pair.paths(remote), 4 * KIB, timeout_s=10)
    assert result.status[0] == IBV_WC_RETRY_EXC_ERR and result.failed_qp[0] == bad
    assert len(result.slice_offset) > 0 and set(result.slice_qp.tolist()) == {bad}
    assert IBV_WC_RETRY_EXC_ERR in result.slice_status.tolist()
    failed = np.zeros(size, bool)
    for off, length in zip(result.slice_offset, result.slice_length, strict=True):
        failed[int(off) : int(off + length)] = True
    assert np.array_equal(src[~failed], dst[~failed])  # every slice not reported arrived
    assert pair.a.qp_state(bad) == "failed"
    n = len(result.slice_offset)
    offs = result.slice_offset.tolist()
    retry = Requests.of([OP_WRITE] * n, [local.handle] * n, offs, offs, result.slice_length)
    assert pair.a.transfer(retry, pair.paths(remote), 4 * KIB, timeout_s=10).is_ok
    assert np.array_equal(src, dst)
    assert pair.a.destroy_qp(bad)


def test_qps_beyond_one_cqs_room_get_cqs_of_their_own():
    """8 QPs of 16 slots on a NIC whose CQs hold 32 entries: the loop adds CQs (4 in all)
    instead of refusing QPs; a batch over all of them moves every byte, and one QP failing
    mid-batch flushes into its own CQ without overrunning it (the fake records overruns)."""
    p = loop_pair(num_nics=1, qps_per_path=8, depth=16, cq_depth=32)
    try:
        size = 2 << 20
        src, dst, local, remote = _buffers(p, size)
        bad = p.qps[5][0]
        assert p.fake.fake_fail_qp(p.qpns[bad], 7, IBV_WC_RETRY_EXC_ERR) == 0
        req = Requests.of([OP_WRITE], [local.handle], [0], [0], [size])
        p.fake.fake_hold(1)  # NOTE: every QP gets its first chain before any completes
        try:
            batch = p.a.submit(req, p.paths(remote), 4 * KIB)
        finally:
            p.fake.fake_hold(0)
        result = batch.wait(timeout_s=10)
        assert result is not None and result.status[0] == IBV_WC_RETRY_EXC_ERR
        assert set(result.slice_qp.tolist()) == {bad} and p.a.qp_state(bad) == "failed"
        n = len(result.slice_offset)
        offs = result.slice_offset.tolist()
        retry = Requests.of([OP_WRITE] * n, [local.handle] * n, offs, offs, result.slice_length)
        assert p.a.transfer(retry, p.paths(remote), 4 * KIB, timeout_s=10).is_ok
        assert np.array_equal(src, dst)
        assert p.fake.fake_num_fatal() == 0, p.fake.fake_last_fatal()
        with pytest.raises(TransferError, match="No space"):  # larger than a whole CQ
            p.a.create_qp(0, 33)
    finally:
        p.close()


def test_a_batch_whose_only_qp_fails_reports_every_unfinished_slice(pair: LoopPair):
    size = 1 << 20
    _, _, local, remote = _buffers(pair, size)
    qp = pair.qps[0][0]
    pair.fake.fake_fail_qp(pair.qpns[qp], 2, IBV_WC_RETRY_EXC_ERR)
    half = size // 2
    req = Requests.of([OP_WRITE] * 2, [local.handle] * 2, [0, half], [0, half], [half] * 2)
    result = pair.a.transfer(req, pair.paths(remote, [qp]), 4 * KIB, timeout_s=10)
    assert result.slice_length.sum() == size - 2 * 4 * KIB  # the first two arrived
    assert rdmaloop.NO_PATH in result.slice_status.tolist()  # never posted: no QP left
    assert result.status[1] == rdmaloop.NO_PATH
    submit_after = pair.a.transfer(req, pair.paths(remote, [qp]), 4 * KIB, timeout_s=10)
    assert submit_after.status.tolist() == [rdmaloop.NO_PATH] * 2


def test_a_closed_region_is_never_posted_and_closes_after_its_batch(pair: LoopPair):
    """A request naming a closed region fails at submit; a region closed while a batch is
    in flight is deregistered only once the batch finished (the fake records any use of a
    deregistered key, which the fixture checks is none)."""
    size = 256 * KIB
    src, dst, local, remote = _buffers(pair, size)
    req = Requests.of([OP_WRITE], [local.handle], [0], [0], [size])
    live = fake_stats(pair.fake)["live_mrs"]
    pair.fake.fake_hold(1)
    try:
        batch = pair.a.submit(req, pair.paths(remote), 4 * KIB)
        assert batch.wait(timeout_s=0) is None  # a poll: still held in the device
        assert batch.wait(timeout_s=0.05) is None
        assert pair.a.close_region(local.handle) is False  # deferred: work in flight
        refused = pair.a.transfer(req, pair.paths(remote), 4 * KIB, timeout_s=5)
        assert refused.status.tolist() == [rdmaloop.BAD_REGION]
        assert fake_stats(pair.fake)["live_mrs"] == live
    finally:
        pair.fake.fake_hold(0)
    result = batch.wait(timeout_s=10)
    assert result is not None and result.is_ok and np.array_equal(src, dst)
    assert fake_stats(pair.fake)["live_mrs"] == live - 2  # on both of its NICs
    stranger = Requests.of([OP_WRITE], [12345], [0], [0], [size])
    assert pair.a.transfer(stranger, pair.paths(remote), 4 * KIB).status[0] == rdmaloop.BAD_REGION


def test_the_fake_records_a_deregistered_key_as_fatal():
    """The check the loop is held to: a work request with a closed MR's lkey is recorded
    as a fatal by the fake (on hardware: a protection error, or worse, a reused key)."""
    p = loop_pair(num_nics=1, qps_per_path=1)
    fake = p.fake
    try:
        src, _, local, remote = _buffers(p, 8 * KIB)
        qp = p.qps[0][0]
        assert p.a.close_region(local.handle) is True
        before = fake.fake_num_fatal()
        assert fake.fake_post_raw(p.qpns[qp], address(src), local.keys[0].lkey, 0, 0, 64) == 0
        fake.fake_run(p.qpns[qp])
        assert fake.fake_num_fatal() == before + 1
        assert b"deregistered" in fake.fake_last_fatal()
    finally:
        p.close()


def test_threads_submit_while_a_python_thread_spins(pair: LoopPair):
    """Four submitting threads share the QPs while a pure-Python thread holds the GIL as
    much as it can: every batch finishes (no deadlock), every byte lands."""
    size = 64 * KIB
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    errors: list[str] = []
    copies = []

    def submit(seed: int) -> None:
        src, dst, local, remote = _buffers(pair, size, seed)
        copies.append((src, dst))
        offs = [0, 16 * KIB, 32 * KIB, 48 * KIB]
        req = Requests.of([OP_WRITE] * 4, [local.handle] * 4, offs, offs, [16 * KIB] * 4)
        for _ in range(30):
            r = pair.a.transfer(req, pair.paths(remote), 4 * KIB, timeout_s=20)
            if not r.is_ok:
                errors.append(str(r.status))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    assert not any(t.is_alive() for t in threads) and not errors
    assert all(np.array_equal(s, d) for s, d in copies)


def test_the_stub_provider_completes_without_moving_bytes():
    """The stub the bench measures: a 64 MiB batch of 64 KiB slices completes, one wake-up
    per batch, with nothing copied (the target buffer stays as it was)."""
    loop = RdmaLoop.create("stub", signal_every=16, max_chain=32)
    if loop is None:
        pytest.skip("the RDMA C loop is not built")
    try:
        nic = loop.open_nic("stub0", 256)
        qps = [loop.create_qp(nic, 128)[0] for _ in range(2)]
        for qp in qps:
            loop.connect_qp(qp, rdmaloop.QpEndpoint("0" * 32, 0, 1, 0, 5, 16), 0, _route())
        buf = np.zeros(64 << 20, np.uint8)
        region = loop.register(address(buf), len(buf))
        key = region.keys[0]
        req = Requests.of([OP_WRITE], [region.handle], [0], [0], [len(buf)])
        paths = Paths(qps, [key.base] * 2, [key.rkey] * 2)
        for _ in range(3):
            assert loop.transfer(req, paths, 64 * KIB, timeout_s=10).is_ok
        stats = loop.stats().counters
        assert stats["work_requests"] == 3 * 1024 and stats["batches"] == 3
        assert stats["wakeups"] <= 3  # one eventfd write per batch its waiter slept on
        assert stats["completions"] == stats["signalled"] < stats["work_requests"] // 8
    finally:
        loop.close()


def _route():
    from mooncake.native.rdma import Route

    return Route(port_num=1, gid_index=0, mtu=5)


def test_a_nics_poller_runs_on_the_cpus_it_is_pinned_to():
    """pin_poller sets the NIC's poller thread's affinity (read back from /proc); a CPU
    beyond the kernel's set is refused."""
    fake = fake_library()
    loop = RdmaLoop.create(fake.fake_provider())
    assert loop is not None
    try:
        nic = loop.open_nic("pintest0", 64)
        cpu = min(os.sched_getaffinity(0))
        loop.pin_poller(nic, [cpu])
        tids = [t for t in os.listdir("/proc/self/task") if _comm(t) == "rl-poll-pintest"]
        assert len(tids) == 1, tids
        status = Path(f"/proc/self/task/{tids[0]}/status").read_text()
        allowed = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
        assert allowed.split()[-1] == str(cpu)
        with pytest.raises(TransferError, match="pinning NIC 0"):
            loop.pin_poller(nic, [1 << 20])
    finally:
        loop.close()


def _comm(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:  # the thread ended
        return ""


def test_fake_library_builds():
    assert fake_library().fake_provider()


def test_threads_posting_while_qps_reset_lose_nothing(pair: LoopPair):
    """Four threads submit while a fifth moves QPs to error, destroys them once drained and
    connects new ones: every failed slice is reported and, retried, lands; nothing crashes
    (the fixture checks the fake recorded no fatal)."""
    from mooncake.native.rdma import QpEndpoint, Route

    lock = threading.Lock()
    current = list(pair.qps)  # (handle, local NIC, remote NIC), replaced as QPs reset
    stop = threading.Event()
    errors: list[str] = []
    size = 256 * KIB

    def paths_now(region) -> Paths:
        with lock:
            chosen = list(current)
        keys = [region.keys[remote] for _, _, remote in chosen]
        return Paths([q for q, _, _ in chosen], [k.base for k in keys], [k.rkey for k in keys])

    num_resets = 0

    def reset_one(k: int, route: Route) -> None:
        with lock:
            qp, local, remote = current[k % len(current)]
        for loop, handle in ((pair.a, qp), (pair.b, pair.peers[qp])):
            loop.to_error(handle)
            deadline = time.monotonic() + 5
            while loop.qp_state(handle) != "failed" and time.monotonic() < deadline:
                time.sleep(0.001)
            assert loop.destroy_qp(handle)
        qa, qpn_a = pair.a.create_qp(local, 64)
        qb, qpn_b = pair.b.create_qp(remote, 64)
        pair.a.connect_qp(qa, QpEndpoint(ZERO_GID, 0, qpn_b, 1, 5, 16), 2, route)
        pair.b.connect_qp(qb, QpEndpoint(ZERO_GID, 0, qpn_a, 2, 5, 16), 1, route)
        pair.peers[qa] = qb
        with lock:
            current[k % len(current)] = (qa, local, remote)

    def reset() -> None:
        nonlocal num_resets
        route = Route(port_num=1, gid_index=0, mtu=5)
        try:
            while not stop.is_set():
                reset_one(num_resets, route)
                num_resets += 1
                time.sleep(0.001)
        except Exception as e:
            errors.append(f"resetter: {e!r}")

    def submit(seed: int) -> None:
        src, dst, local, remote = _buffers(pair, size, seed)
        for _ in range(60):
            dst[:] = 0
            req = Requests.of([OP_WRITE], [local.handle], [0], [0], [size])
            for _attempt in range(20):
                r = pair.a.transfer(req, paths_now(remote), 4 * KIB, timeout_s=20)
                if r.is_ok:
                    break
                n, offs = len(r.slice_offset), r.slice_offset.tolist()
                req = Requests.of([OP_WRITE] * n, [local.handle] * n, offs, offs, r.slice_length)
            if not np.array_equal(src, dst):
                errors.append(f"thread {seed}: bytes differ")

    resetter = threading.Thread(target=reset)
    resetter.start()
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    resetter.join(30)
    assert not any(t.is_alive() for t in (*threads, resetter)) and not errors
    assert num_resets >= 3 and pair.a.stats().counters["post_errors"] == 0
