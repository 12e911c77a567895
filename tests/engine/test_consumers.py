"""The Transfer Engine calls of vLLM's MooncakeConnector (vllm/distributed/kv_transfer/
kv_connector/v1/mooncake/mooncake_connector.py) and SGLang's MooncakeTransferEngine
(python/sglang/srt/disaggregation/mooncake/transfer_engine.py), replayed as they make them,
against a peer engine in another process. Each checks what the consumer checks (return
codes) and the bytes that landed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mooncake.engine import TransferEngine
from tests.engine.conftest import PEER_BYTES
from tests.engine.peer import pattern

pytestmark = pytest.mark.cluster  # a peer engine in a child process
KiB = 1024


@pytest.fixture
def force_tcp(secret_env, monkeypatch):
    monkeypatch.setenv("MC_FORCE_TCP", "1")


def test_vllm_default_rdma_protocol_starts_where_no_nic_is(secret_env, monkeypatch):
    """vLLM's default mooncake_protocol is "rdma" (SGLang's MOONCAKE_PROTOCOL too):
    upstream's engine auto-discovers and runs over TCP where no RDMA NIC opens, so
    initialize(ip, "P2PHANDSHAKE", "rdma", "") is 0 and get_rpc_port() a port; with
    MC_FORCE_TCP set (SGLang's switch) the engine's transport is tcp."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert te.get_rpc_port() > 0
    finally:
        te.close()
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    te = TransferEngine()
    try:
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        inner = te.get_engine()
        assert inner is not None and inner.options.protocol == "tcp"
    finally:
        te.close()


def test_vllm_sender_threads_write_layer_regions_into_whole_storages(engine, peer):
    """vLLM registers each layer's whole storage once (batch_register_memory of
    untyped_storage() pointers), derives region bases inside it (a K/V half each), and its
    sender pool (10 threads) calls batch_transfer_sync_write(f"{ip}:{rpc_port}", ...)
    concurrently, coalesced runs of blocks included; every call is 0 and each block lands
    at its remote address."""
    num_layers, num_blocks, block = 2, 8, 4 * KiB
    half = num_blocks * block  # one K or V region of a layer
    layers = [pattern(2 * half, 13 * i) for i in range(num_layers)]
    ptrs = [layer.ctypes.data for layer in layers]
    assert engine.batch_register_memory(ptrs, [layer.nbytes for layer in layers]) == 0
    local_regions = [p + kv * half for p in ptrs for kv in (0, 1)]
    remote_regions = [peer.address + r * half for r in range(len(local_regions))]
    assert remote_regions[-1] + half <= peer.address + PEER_BYTES

    def send(region: int) -> int:
        # blocks 0-2 coalesced into one copy, then 5 and 7 one by one (to 7, 1, 2 there)
        src = [local_regions[region], local_regions[region] + 5 * block]
        src.append(local_regions[region] + 7 * block)
        dst = [remote_regions[region] + 4 * block, remote_regions[region] + block]
        dst.append(remote_regions[region] + 2 * block)
        # NOTE: the coalesced run lands at blocks 4-6, the singles at 1 and 2
        return engine.batch_transfer_sync_write(peer.name, src, dst, [3 * block, block, block])

    with ThreadPoolExecutor(max_workers=10) as pool:
        assert list(pool.map(send, range(len(local_regions)))) == [0] * len(local_regions)
    remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
    for region in range(len(local_regions)):
        blocks = layers[region // 2][(region % 2) * half :][:half]
        there = remote[region * half : (region + 1) * half]
        assert np.array_equal(there[4 * block : 7 * block], blocks[: 3 * block])
        assert np.array_equal(there[block : 2 * block], blocks[5 * block : 6 * block])
        assert np.array_equal(there[2 * block : 3 * block], blocks[7 * block :])
    assert engine.batch_unregister_memory(ptrs) == 0


def test_sglang_engine_with_mc_force_tcp_batch_calls_and_failed_session_probe(force_tcp, peer):
    """SGLang: initialize(ip, "P2PHANDSHAKE", "rdma", "") under MC_FORCE_TCP=1, session id
    f"{ip}:{get_rpc_port()}", batch_register([ptrs], [lengths]) 0, batch_transfer_sync_write
    0, a write from memory it never registered < 0 (logged, no exception: SGLang counts the
    session failed), send_probe of that dead session -1 and of the live one 0 (its
    failed-session probe loop), batch_unregister_memory 0, get_engine() not None."""
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    try:
        session_id = f"127.0.0.1:{te.get_rpc_port()}"
        assert session_id.rsplit(":", 1)[1].isdigit() and te.get_engine() is not None
        pages = [pattern(16 * KiB, 5 + i) for i in range(3)]
        ptrs = [p.ctypes.data for p in pages]
        assert te.batch_register_memory(ptrs, [p.nbytes for p in pages]) == 0
        dsts = [peer.address + 600 * KiB + i * 16 * KiB for i in range(3)]
        assert te.batch_transfer_sync_write(peer.name, ptrs, dsts, [16 * KiB] * 3) == 0
        remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
        for i, page in enumerate(pages):
            assert np.array_equal(remote[600 * KiB + i * 16 * KiB :][: 16 * KiB], page)
        stray = np.zeros(KiB, dtype=np.uint8)
        assert te.transfer_sync_write(peer.name, stray.ctypes.data, peer.address, KiB) < 0
        dead = TransferEngine()
        assert dead.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        dead_session = f"127.0.0.1:{dead.get_rpc_port()}"
        dead.close()
        assert te.send_probe(dead_session) == -1
        assert te.send_probe(peer.name) == 0
        assert te.batch_unregister_memory(ptrs) == 0
        assert te.transfer_sync_write(peer.name, ptrs[0], peer.address, KiB) < 0
    finally:
        te.close()
