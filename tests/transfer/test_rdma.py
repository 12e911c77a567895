"""The rdma transport's logic on the verbs emulator (tests/transfer/fake_verbs.py):
memory registration on every NIC, the RDMA_CONNECT queue-pair handshake, one-sided
READ/WRITE, striping over NIC pairs, retry on another NIC when one link is cut, and queue
pairs across processes. No RDMA hardware is involved: see test_pyverbs_api.py for what is
checked against pyverbs, and test_rdma_{load,faults,addressing}.py for the rest."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.transfer import EngineOptions, TransferEngine, TransferOp, TransferRequest
from tests.transfer import fake_verbs
from tests.transfer.conftest import SECRET
from tests.transfer.peer import PeerProcess, pattern

READ, WRITE = TransferOp.READ, TransferOp.WRITE


def _engine(name: str, **options: object) -> TransferEngine:
    opts = EngineOptions(protocol="rdma", slice_bytes=4096, connections_per_peer=2, **options)  # type: ignore[arg-type]
    return TransferEngine(name, SECRET, opts, verbs=fake_verbs)


@pytest.fixture
def pair(emulator) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    a, b = _engine("a"), _engine("b")
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        yield a, b
    finally:
        fake_verbs.cut("fake_1", False)
        a.close()
        b.close()


def test_write_and_read_over_queue_pairs_striped_on_every_nic_pair(pair) -> None:
    a, b = pair
    pool = b.allocate("pool", 1 << 18)
    src, dst = pattern(1 << 17), np.zeros(1 << 17, np.uint8)
    a.register("src", src)
    a.register("dst", dst)
    desc = a.resolve("pool").desc
    assert [k.nic for k in desc.rdma] == ["fake_0", "fake_1"] and "rdma" in desc.protocols
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 100, 1 << 17)]).check(5.0)
    assert (pool[100 : 100 + (1 << 17)] == src).all()
    a.submit([TransferRequest(READ, "dst", 0, "pool", 100, 1 << 17)]).check(5.0)
    assert (dst == src).all()
    paths = a.resolve("pool").pathsets["cpu:0"].paths
    assert len(paths) == 4 and all(p.num_slices > 0 for p in paths)  # 2 local x 2 remote NICs


def test_cut_nic_slices_are_retried_on_the_other_nic(pair) -> None:
    a, b = pair
    pool = b.allocate("pool", 1 << 17)
    src = pattern(1 << 17, offset=3)
    a.register("src", src)
    fake_verbs.cut("fake_1")
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 17)]).check(5.0)
    assert (pool == src).all()
    assert a.num_retries > 0
    cut_paths = [p for p in a.resolve("pool").pathsets["cpu:0"].paths if p.local_nic == "fake_1"]
    assert all(p.num_failures > 0 and p.num_slices == 0 for p in cut_paths)


def test_rdma_required_without_devices_is_a_clear_error(emulator) -> None:
    emulator.DEVICES.clear()
    with pytest.raises(TransferError, match="no RDMA device"):
        _engine("x")


@pytest.mark.cluster
def test_queue_pairs_across_processes_reach_the_peers_shared_memory(emulator) -> None:
    peer = PeerProcess.start(SECRET, 1 << 16, fake_rdma=True)
    try:
        with _engine("init") as e:
            e.directory.add_peer("127.0.0.1", peer.port)  # type: ignore[attr-defined]
            dst = np.zeros(1 << 16, np.uint8)
            e.register("dst", dst)
            assert e.resolve("pool").transport.name == "rdma"
            e.submit([TransferRequest(READ, "dst", 0, "pool", 0, 1 << 16)]).check(5.0)
            assert (dst == pattern(1 << 16)).all()
            e.register("zeros", np.zeros(1 << 16, np.uint8))
            e.submit([TransferRequest(WRITE, "zeros", 0, "pool", 0, 1 << 16)]).check(5.0)
            assert peer.call("checksum") == 0
    finally:
        peer.kill()
