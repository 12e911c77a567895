"""Failure behaviour against a real peer process: a peer that freezes or dies mid-batch
fails the batch within its deadline (never a hang, never a partial write reported as done),
dropped connections are re-opened on next use, and a path that keeps failing is paused."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mooncake.native.shm import ShmArena
from mooncake.transfer import TransferOp, TransferRequest, TransferState
from tests.transfer.conftest import SECRET, make_engine
from tests.transfer.peer import PeerProcess, pattern

pytestmark = pytest.mark.cluster

READ, WRITE = TransferOp.READ, TransferOp.WRITE
DONE = TransferState.DONE


def _initiator(peer: PeerProcess, **options: object):
    e = make_engine("init", protocol="tcp", **options)
    e.directory.add_peer("127.0.0.1", peer.port)  # type: ignore[attr-defined]
    return e


def test_frozen_peer_fails_the_batch_by_its_deadline(peer: PeerProcess) -> None:
    with _initiator(peer, timeout_s=1.5, retry_budget=1) as e:
        dst = np.zeros(1 << 20, np.uint8)
        e.register("dst", dst)
        e.submit([TransferRequest(READ, "dst", 0, "pool", 0, 4096)]).check(5.0)  # warm
        peer.stop_signal()  # holds its sockets open but never answers
        batch = e.submit([TransferRequest(READ, "dst", 0, "pool", 0, 1 << 20)])
        statuses = batch.wait()  # bounded by the batch deadline
        assert batch.is_done
        assert statuses[0].state in (TransferState.FAILED, TransferState.TIMED_OUT)
        assert statuses[0].reason


def test_peer_killed_mid_batch_never_reports_a_lost_write_as_done(peer: PeerProcess) -> None:
    with _initiator(peer, timeout_s=3.0) as e:
        src = pattern(1 << 20, offset=7)
        e.register("src", src)
        e.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 4096)]).check(5.0)  # warm
        reqs = [TransferRequest(WRITE, "src", k << 14, "pool", k << 14, 1 << 14) for k in range(64)]
        batch = e.submit(reqs)
        peer.kill_only()
        statuses = batch.wait(10.0)
        assert batch.is_done
        with ShmArena.attach(peer.shm_name) as pool:  # the dead peer's memory, still in /dev/shm
            for req, st in zip(reqs, statuses, strict=True):
                if st.state is DONE:
                    got = pool.array[req.remote_offset : req.remote_offset + req.length]
                    assert (got == src[req.local_offset : req.local_offset + req.length]).all()
                else:
                    assert st.state is TransferState.FAILED and "tcp 127.0.0.1" in st.reason


def test_dropped_connections_are_reopened_on_next_use(peer: PeerProcess) -> None:
    with _initiator(peer) as e:
        dst = np.zeros(1 << 16, np.uint8)
        e.register("dst", dst)
        req = TransferRequest(READ, "dst", 0, "pool", 0, 1 << 16)
        e.submit([req]).check(5.0)
        assert peer.call("drop") >= 1
        dst[:] = 0
        e.submit([req]).check(5.0)
        assert (dst == pattern(1 << 16)).all()


def test_path_that_keeps_failing_is_paused_and_then_fails_fast(peer: PeerProcess) -> None:
    with _initiator(peer, retry_budget=3, pause_after_failures=2, pause_s=30.0) as e:
        e.register("dst", np.zeros(4096, np.uint8))
        req = TransferRequest(READ, "dst", 0, "pool", 0, 4096)
        e.submit([req]).check(5.0)
        peer.kill()
        first = e.submit([req]).wait(10.0)[0]
        assert first.state is TransferState.FAILED
        (path,) = e.resolve("pool").pathsets["cpu:0"].paths
        assert path.is_paused()
        second = e.submit([req]).wait(10.0)[0]
        assert second.state is TransferState.FAILED and "paused" in second.reason


def test_transfer_retries_on_a_fresh_connection_after_the_peer_dropped_it(
    peer: PeerProcess,
) -> None:
    """transfer() keeps its connections between calls; when the peer drops them, the
    failed slice is retried (on a new connection) and the bytes arrive."""
    with _initiator(peer) as e:
        dst = np.zeros(4096, np.uint8)
        e.register("dst", dst)
        req = TransferRequest(READ, "dst", 0, "pool", 0, 4096)
        e.transfer([req]).check(5.0)
        assert peer.call("drop") >= 1
        dst[:] = 0
        e.transfer([req]).check(5.0)
        assert (dst == pattern(4096)).all()


def test_transfer_to_a_killed_peer_fails_within_the_deadline(peer: PeerProcess) -> None:
    with _initiator(peer, timeout_s=2.0, retry_budget=1) as e:
        e.register("dst", np.zeros(4096, np.uint8))
        req = TransferRequest(READ, "dst", 0, "pool", 0, 4096)
        e.transfer([req]).check(5.0)
        peer.kill()
        batch = e.transfer([req])
        assert batch.is_done and batch.poll()[0].state is not DONE


def test_a_peer_restarted_again_and_again_leaves_no_arena_of_its_earlier_lives_mapped() -> None:
    """A peer SIGKILLed and started again under its name 20 times, its shm segment written
    each time at its new endpoint: the initiator keeps only the latest life's arena mapped.
    One kept per life would hold each dead process's segment resident here for good."""
    e = make_engine("init", protocol="shm")
    e.register("src", pattern(4096))
    lives: list[str] = []  # shm names of the peer's arenas, one per life
    try:
        for _ in range(21):
            peer = PeerProcess.start(SECRET, 1 << 16)
            try:
                e.move(TransferRequest(WRITE, "src", 0, f"pool@127.0.0.1:{peer.port}", 0, 4096))
            finally:
                peer.kill()
            lives.append(peer.shm_name)
        gc.collect()
        with open("/proc/self/maps") as f:
            maps = f.read()
    finally:
        e.close()
    assert [name for name in lives[:-1] if name in maps] == []
    assert lives[-1] in maps  # NOTE: the check sees the mappings this process holds
