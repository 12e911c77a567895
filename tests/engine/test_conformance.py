"""Conformance of mooncake.engine.TransferEngine with upstream's Python API reference
(docs/source/api-reference/python/transfer-engine.md in kvcache-ai/Mooncake) and its
return conventions (transfer_engine_py.cpp: 0 / -1 for transfers, a batch id or 0 for
async submits, error.h's codes for registration), over tcp, against an engine in another
process where the peer matters. Every byte moved is read back and compared."""

from __future__ import annotations

import time

import numpy as np
import pytest

import mooncake.engine as engine_module
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
from mooncake.engine.pointers import cuda_supported
from mooncake.transfer import TransferEngine as InnerEngine
from tests.engine.conftest import PEER_BYTES
from tests.engine.peer import Peer, pattern

pytestmark = pytest.mark.cluster  # a peer engine in a child process
KiB = 1024


def addr(a: np.ndarray, offset: int = 0) -> int:
    return a.ctypes.data + offset


def test_vllm_connector_pattern_batch_write_lands_byte_for_byte(engine, peer):
    """vLLM's MooncakeConnector: batch_register_memory, then batch_transfer_sync_write to
    "ip:port" with the peer's raw addresses returns 0 and the peer holds exactly the bytes."""
    src = np.random.default_rng(1).integers(0, 256, 256 * KiB, dtype=np.uint8)
    assert engine.batch_register_memory([addr(src)], [src.nbytes]) == 0
    # three blocks of the local buffer scattered over the peer's buffer
    srcs = [addr(src, 0), addr(src, 64 * KiB), addr(src, 200 * KiB)]
    dsts = [peer.address + 4096, peer.address + 512 * KiB, peer.address + 1000 * KiB]
    lengths = [64 * KiB, 100 * KiB, 24 * KiB]
    before = np.frombuffer(peer.call("bytes"), dtype=np.uint8).copy()
    assert engine.batch_transfer_sync_write(peer.name, srcs, dsts, lengths) == 0
    after = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
    expected = before.copy()
    for s, d, n in zip(srcs, dsts, lengths, strict=True):
        expected[d - peer.address : d - peer.address + n] = src[s - addr(src) : s - addr(src) + n]
    assert np.array_equal(after, expected)
    # and back: batch_transfer_sync_read brings the same bytes home
    back = np.zeros(188 * KiB, dtype=np.uint8)
    assert engine.register_memory(addr(back), back.nbytes) == 0
    outs = [addr(back, 0), addr(back, 64 * KiB), addr(back, 164 * KiB)]
    assert engine.batch_transfer_sync_read(peer.name, outs, dsts, lengths) == 0
    assert np.array_equal(
        back,
        np.concatenate([src[: 64 * KiB], src[64 * KiB : 164 * KiB], src[200 * KiB : 224 * KiB]]),
    )


def test_sglang_pattern_register_write_probe_unregister(engine, peer):
    """SGLang's backend: register_memory, transfer_sync_write (0), send_probe (0),
    get_engine (our inner engine), unregister_memory (0), after which the same local
    address is refused (-1) and nothing moves."""
    src = pattern(8 * KiB, 3)
    assert engine.register_memory(addr(src), src.nbytes) == 0
    assert engine.transfer_sync_write(peer.name, addr(src), peer.address + 8 * KiB, 8 * KiB) == 0
    got = np.frombuffer(peer.call("bytes"), dtype=np.uint8)[8 * KiB : 16 * KiB]
    assert np.array_equal(got, src)
    assert engine.send_probe(peer.name) == 0
    assert isinstance(engine.get_engine(), InnerEngine)
    assert engine.unregister_memory(addr(src)) == 0
    other = np.full(8 * KiB, 9, dtype=np.uint8)
    src[:] = other
    assert engine.transfer_sync_write(peer.name, addr(src), peer.address + 8 * KiB, 8 * KiB) == -1
    got = np.frombuffer(peer.call("bytes"), dtype=np.uint8)[8 * KiB : 16 * KiB]
    assert np.array_equal(got, pattern(8 * KiB, 3))


def test_transfer_sync_read_and_opcode_forms(engine, peer):
    """transfer_sync_read, transfer_sync and batch_transfer_sync with TransferOpcode move
    the bytes their opcode says."""
    buf = np.zeros(32 * KiB, dtype=np.uint8)
    assert engine.register_memory(addr(buf), buf.nbytes) == 0
    assert engine.transfer_sync_read(peer.name, addr(buf), peer.address + 300 * KiB, 4 * KiB) == 0
    remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
    assert np.array_equal(buf[: 4 * KiB], remote[300 * KiB : 304 * KiB])
    rc = engine.transfer_sync(
        peer.name, addr(buf, 4 * KiB), peer.address + 310 * KiB, 4 * KiB, TransferOpcode.READ
    )
    assert rc == 0 and np.array_equal(buf[4 * KiB : 8 * KiB], remote[310 * KiB : 314 * KiB])
    buf[8 * KiB :] = 77
    rc = engine.batch_transfer_sync(
        peer.name,
        [addr(buf, 8 * KiB), addr(buf, 16 * KiB)],
        [peer.address + 320 * KiB, peer.address + 330 * KiB],
        [8 * KiB, 8 * KiB],
        TransferOpcode.Write,
    )
    assert rc == 0
    remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8)
    assert (remote[320 * KiB : 328 * KiB] == 77).all() and (
        remote[330 * KiB : 338 * KiB] == 77
    ).all()


def test_notify_reaches_the_peers_get_notifies(engine, peer):
    """transfer_sync with a TransferNotify delivers it after the bytes; the peer's
    get_notifies() returns it once."""
    buf = pattern(4 * KiB, 11)
    assert engine.register_memory(addr(buf), buf.nbytes) == 0
    note = TransferNotify("req-17", "layer 3 done")
    rc = engine.transfer_sync(
        peer.name, addr(buf), peer.address + 400 * KiB, 4 * KiB, TransferOpcode.Write, note
    )
    assert rc == 0
    assert peer.call("notifies") == [("req-17", "layer 3 done")]
    assert peer.call("notifies") == []
    assert engine.get_notifies() == []


def test_async_batches_return_ids_and_status(engine, peer):
    """batch_transfer_async_write/_read return distinct ids > 0; get_batch_transfer_status
    waits and returns 0; transfer_submit_write's id polls to 1; a spent or unknown id is -1;
    a submit that cannot start returns 0."""
    src = pattern(128 * KiB, 5)
    dst = np.zeros(128 * KiB, dtype=np.uint8)
    assert engine.batch_register_memory([addr(src), addr(dst)], [src.nbytes, dst.nbytes]) == 0
    w = engine.batch_transfer_async_write(
        peer.name,
        [addr(src), addr(src, 64 * KiB)],
        [peer.address, peer.address + 64 * KiB],
        [64 * KiB] * 2,
    )
    assert w > 0
    assert engine.get_batch_transfer_status([w]) == 0
    r = engine.batch_transfer_async_read(peer.name, [addr(dst)], [peer.address], [128 * KiB])
    r2 = engine.batch_transfer_async(
        peer.name, [addr(dst)], [peer.address], [4 * KiB], TransferOpcode.Read
    )
    assert r > 0 and r2 > 0 and len({w, r, r2}) == 3
    assert engine.get_batch_transfer_status([r, r2]) == 0
    assert np.array_equal(dst, src)
    assert engine.get_batch_transfer_status([r]) == -1  # spent
    s = engine.transfer_submit_write(peer.name, addr(src), peer.address + 200 * KiB, 16 * KiB)
    assert s > 0
    deadline = time.monotonic() + 30
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = engine.transfer_check_status(s)
    assert status == 1
    assert engine.transfer_check_status(s) == -1
    assert engine.batch_transfer_async_write(peer.name, [addr(src)], [16], [4 * KiB]) == 0


def test_managed_buffers_round_trip(engine, peer):
    """allocate_managed_buffer gives a registered zero-filled buffer; write_bytes_to_buffer
    and read_bytes_from_buffer reach it; it transfers to the peer; free gives 0, twice -3."""
    m = engine.allocate_managed_buffer(64 * KiB)
    assert m != 0
    assert engine.read_bytes_from_buffer(m, 16) == bytes(16)
    data = b"Test data for managed buffer"
    assert engine.write_bytes_to_buffer(m, data, len(data)) == 0
    assert engine.read_bytes_from_buffer(m, len(data)) == data
    assert engine.transfer_sync_write(peer.name, m, peer.address + 500 * KiB, len(data)) == 0
    remote = peer.call("bytes")
    assert remote[500 * KiB : 500 * KiB + len(data)] == data
    assert engine.unregister_memory(m) < 0  # managed buffers are freed, not unregistered
    assert engine.free_managed_buffer(m, 64 * KiB) == 0
    assert engine.free_managed_buffer(m, 64 * KiB) == -3
    with pytest.raises(ValueError, match="not inside host memory registered"):
        engine.read_bytes_from_buffer(m, 4)
    assert engine.write_bytes_to_buffer(m, data, len(data)) == -3


def test_get_first_buffer_address(engine, peer):
    """get_first_buffer_address of a peer is the first buffer it registered; of a peer
    with none, or unreachable, 0; of this engine's own name, its own first buffer."""
    assert engine.get_first_buffer_address(peer.name) == peer.address
    assert engine.get_first_buffer_address("127.0.0.1:1") == 0
    own = f"127.0.0.1:{engine.get_rpc_port()}"
    assert engine.get_first_buffer_address(own) == 0
    mine = np.zeros(4096, dtype=np.uint8)
    assert engine.register_memory(addr(mine), mine.nbytes) == 0
    assert engine.get_first_buffer_address(own) == addr(mine)


def test_errors_are_negative_codes(engine, peer):
    """Bad input returns upstream's negative codes, never raises: unknown or malformed
    peer, peer address outside its memory, unregistered local memory, mismatched lists,
    zero length, overlapping or unmapped registration, unknown unregistration."""
    buf = np.zeros(8 * KiB, dtype=np.uint8)
    assert engine.register_memory(addr(buf), buf.nbytes) == 0
    assert engine.transfer_sync_write("127.0.0.1:1", addr(buf), peer.address, 16) == -1
    assert engine.transfer_sync_write("no-port", addr(buf), peer.address, 16) == -1
    assert engine.send_probe("127.0.0.1:1") != 0
    assert engine.transfer_sync_write(peer.name, addr(buf), peer.address + PEER_BYTES - 8, 16) == -1
    assert engine.transfer_sync_write(peer.name, addr(buf), 4096, 16) == -1
    assert engine.transfer_sync_read(peer.name, addr(buf, 8 * KiB - 8), peer.address, 16) == -1
    assert engine.transfer_sync_read(peer.name, 4096, peer.address, 16) == -1
    assert engine.batch_transfer_sync_write(peer.name, [addr(buf)], [peer.address] * 2, [8]) == -1
    assert engine.transfer_sync_write(peer.name, addr(buf), peer.address, 0) == -1
    assert engine.transfer_sync(peer.name, addr(buf), peer.address, 8, 5) == -1
    assert engine.register_memory(addr(buf, 4096), 8 * KiB) == -7
    assert engine.register_memory(16, 4096) < 0
    assert engine.unregister_memory(addr(buf, 1)) == -3
    assert engine.batch_register_memory([addr(buf)], [1, 2]) < 0
    assert np.array_equal(buf, np.zeros_like(buf))  # no failed read wrote anything


def test_uninitialized_and_refused_initialize(secret_env):
    """Before initialize() calls refuse (-1, 0 for addresses); initialize refuses a
    protocol or metadata kind we do not have, and a second initialize."""
    te = TransferEngine()
    buf = np.zeros(4096, dtype=np.uint8)
    assert te.get_rpc_port() == -1
    assert te.get_engine() is None
    assert te.register_memory(addr(buf), 4096) == -1
    assert te.allocate_managed_buffer(4096) == 0
    assert te.transfer_sync_write("127.0.0.1:1", addr(buf), 0, 8) == -1
    assert te.batch_transfer_async_write("127.0.0.1:1", [addr(buf)], [0], [8]) == 0
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") < 0
    assert te.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") < 0
    assert te.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    try:
        assert te.get_rpc_port() > 0
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0
    finally:
        te.close()


def test_peer_buffer_registered_again_is_reached_through_its_new_token(engine, secret_env):
    """A peer that unregisters a buffer and registers the same address again gets a new
    token: the cached answer is refused by the peer, asked again, and the write lands."""
    p = Peer.start(secret_env, 64 * KiB)
    try:
        src = pattern(4 * KiB, 1)
        assert engine.register_memory(addr(src), src.nbytes) == 0
        assert engine.transfer_sync_write(p.name, addr(src), p.address, 4 * KiB) == 0
        assert p.call("reregister") == 0
        src[:] = 42
        assert engine.transfer_sync_write(p.name, addr(src), p.address, 4 * KiB) == 0
        remote = np.frombuffer(p.call("bytes"), dtype=np.uint8)
        assert (remote[: 4 * KiB] == 42).all()
        assert np.array_equal(remote[4 * KiB :], pattern(64 * KiB, 7)[4 * KiB :])
    finally:
        p.stop()


def test_peer_with_another_secret_is_refused(engine, secret_env):
    """The data plane is authenticated: a peer started with another cluster secret can be
    neither probed nor written (-1)."""
    p = Peer.start({**secret_env, "MOONCAKE_CLUSTER_SECRET": "another-secret-0123456789"}, 4096)
    try:
        src = np.ones(4096, dtype=np.uint8)
        assert engine.register_memory(addr(src), src.nbytes) == 0
        assert engine.send_probe(p.name) == -1
        assert engine.transfer_sync_write(p.name, addr(src), p.address, 4096) == -1
        assert (np.frombuffer(p.call("bytes"), dtype=np.uint8) == pattern(4096)).all()
    finally:
        p.stop()


def test_capability_flags_and_opcodes():
    """Capability flags are true only for what we do (no EFA, HIP, MNNVL, MUSA, intra-node
    NVLink; CUDA only where device pointers can be registered); TransferOpcode has
    upstream's values and both spellings, also as TransferEngine.TransferOpcode."""
    for flag in ("EFA", "HIP", "MNNVL", "MUSA", "INTRA_NVLINK"):
        assert getattr(engine_module, f"SUPPORT_{flag}") is False
    assert engine_module.SUPPORT_CUDA is cuda_supported()
    assert (TransferOpcode.Read, TransferOpcode.Write) == (0, 1)
    assert (
        TransferOpcode.READ is TransferOpcode.Read and TransferOpcode.WRITE is TransferOpcode.Write
    )
    assert TransferEngine.TransferOpcode is TransferOpcode
    assert not hasattr(TransferEngine, "transfer_write_on_cuda")  # left out: probes fall back
