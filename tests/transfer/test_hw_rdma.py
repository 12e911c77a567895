"""On an RDMA node (marker `rdma`; skipped elsewhere, see tests/conftest.py): transfers
through a real NIC with real pyverbs. The target is another process on this host, reached
over the NIC (transfer.protocol = "rdma" on the initiator: no shm shortcut)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.transfer import EngineOptions, TransferEngine, TransferRequest
from mooncake.transfer.types import TransferOp, TransferState
from tests.transfer.conftest import SECRET
from tests.transfer.peer import PeerProcess, pattern

pytestmark = [pytest.mark.cluster, pytest.mark.rdma, pytest.mark.timeout(300)]
MAX_BYTES = 256 << 20
SIZES = [64 << 10, 1 << 20, 4 << 20 | 4096 | 13, 64 << 20, MAX_BYTES]  # 64 KiB .. 256 MiB


def _initiator(timeout_s: float = 30.0) -> TransferEngine:
    return TransferEngine(
        "hw-initiator", SECRET, EngineOptions(protocol="rdma", timeout_s=timeout_s)
    )


@pytest.fixture
def big_peer() -> Iterator[PeerProcess]:
    p = PeerProcess.start(SECRET, MAX_BYTES)
    try:
        yield p
    finally:
        p.kill()


@pytest.mark.parametrize("op", [TransferOp.READ, TransferOp.WRITE])
def test_host_memory_through_the_nic_byte_for_byte(big_peer: PeerProcess, op: TransferOp) -> None:
    """READ and WRITE of 64 KiB to 256 MiB through the NIC, each compared byte for byte."""
    engine = _initiator()
    try:
        engine.directory.add_peer("127.0.0.1", big_peer.port)  # type: ignore[attr-defined]
        local = engine.allocate("local", MAX_BYTES)
        assert "rdma" in engine.transport_names
        for size in SIZES:
            if op is TransferOp.READ:
                local[:size] = 0
                engine.transfer([TransferRequest(op, "local", 0, "pool", 0, size)]).check()
                assert np.array_equal(local[:size], pattern(size)), size
            else:
                local[:size] = pattern(size, offset=size % 251 + 1)
                engine.transfer([TransferRequest(op, "local", 0, "pool", 0, size)]).check()
                back = engine.allocate(f"back{size}", size)
                read = TransferRequest(TransferOp.READ, f"back{size}", 0, "pool", 0, size)
                engine.transfer([read]).check()
                assert np.array_equal(back, local[:size]), size
        assert engine.bytes_by_transport().get("rdma", 0) >= sum(SIZES)
    finally:
        engine.close()


def test_target_killed_mid_run_ends_every_request_and_leaves_the_engine_usable() -> None:
    """A batch in flight when its target is SIGKILLed ends (failed or timed out, never
    hung, no crash); a new target is served by the same engine afterwards."""
    peer = PeerProcess.start(SECRET, MAX_BYTES)
    engine = _initiator(timeout_s=10.0)
    try:
        engine.directory.add_peer("127.0.0.1", peer.port)  # type: ignore[attr-defined]
        engine.allocate("local", MAX_BYTES)
        reqs = [TransferRequest(TransferOp.WRITE, "local", 0, "pool", 0, MAX_BYTES)] * 8
        batch = engine.submit(reqs)
        time.sleep(0.05)
        peer.kill()
        statuses = batch.wait()
        assert batch.is_done
        assert all(s.state is not TransferState.PENDING for s in statuses)
        assert any(s.state is not TransferState.DONE for s in statuses)
    finally:
        peer.kill()
    fresh = PeerProcess.start(SECRET, 1 << 20)
    try:
        name = f"pool@127.0.0.1:{fresh.port}"
        engine.transfer([TransferRequest(TransferOp.READ, "local", 0, name, 0, 1 << 20)]).check()
    finally:
        fresh.kill()
        engine.close()


NETDEV = os.environ.get("MOONCAKE_HWTEST_NETDEV", "")


@pytest.mark.skipif(
    not NETDEV,
    reason="set MOONCAKE_HWTEST_NETDEV to the netdev of one of two "
    "RDMA NICs to take it down and up (disruptive: a test node only)",
)
def test_a_link_taken_down_and_up_during_a_run(big_peer: PeerProcess) -> None:
    """While transfers run, one NIC's link goes down for 2 s and comes back: every request
    ends DONE (retried on the other NIC) or with a TransferError naming what failed; none
    hangs, the process survives, and transfers succeed again once the link is up."""
    engine = _initiator(timeout_s=10.0)
    outcomes: list[str] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                engine.transfer(
                    [TransferRequest(TransferOp.WRITE, "local", 0, "pool", 0, 16 << 20)]
                ).check()
                outcomes.append("done")
            except TransferError as e:
                outcomes.append(f"error: {e}")

    try:
        engine.directory.add_peer("127.0.0.1", big_peer.port)  # type: ignore[attr-defined]
        engine.allocate("local", 16 << 20)
        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(1.0)
        subprocess.run(["ip", "link", "set", "dev", NETDEV, "down"], check=True)
        time.sleep(2.0)
        subprocess.run(["ip", "link", "set", "dev", NETDEV, "up"], check=True)
        time.sleep(5.0)  # the port retrains
        stop.set()
        worker.join(60)
        assert not worker.is_alive(), "a transfer hung"
        assert outcomes and outcomes[-1] == "done", outcomes[-5:]
        assert all(o == "done" or "error: " in o for o in outcomes)
    finally:
        stop.set()
        subprocess.run(["ip", "link", "set", "dev", NETDEV, "up"], check=False)
        engine.close()
