"""MooncakeDistributedStore calls as vLLM's MooncakeStoreConnector (vllm/distributed/
kv_transfer/kv_connector/v1/mooncake/store/worker.py), LMCache's mooncakestore connector
(lmcache/v1/storage_backend/connector/mooncakestore_connector.py) and SGLang's HiCache
backend make them, beyond test_dropin_consumers.py: the setup forms they use, the codes
they branch on (-200 for a full pool, per-key sizes, 1/0), the shapes they read
(batch_get_replica_desc's dict of descriptors, BufferHandle as a buffer), their threads,
and a bad pointer refused rather than read. Against a master child process. (SGLang's
poll of the master's GET /get_all_segments: tests/roles/master/test_mooncake_master_script.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.store.dropin import MIB, master, secret_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
KIB = 1 << 10
NO_AVAILABLE_HANDLE = -200  # vLLM's MOONCAKE_NO_AVAILABLE_HANDLE: the pool is full
INVALID_PARAMS = -600


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with secret_env(), master() as addr:
        yield addr


def _setup(addr: str, segment: int, protocol: str = "tcp") -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", segment, 16 * MIB, protocol, "", addr)
    assert rc == 0, rc
    return store


def test_vllm_store_worker_round_trip(cluster, monkeypatch) -> None:
    """vLLM's worker: setup with its default protocol "rdma" and no device (upstream falls
    back to TCP without a NIC), a ReplicateConfig naming a preferred segment,
    register_buffer of each KV storage, batch_is_exist to dedup, batch_put_from_multi_buffers
    (a K and a V fragment per key), batch_get_into_multi_buffers with three arguments from
    its receive threads, batch_get_replica_desc's predicates its tier log calls,
    remove_all(force=True) and close() twice."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    writer = _setup(cluster, 32 * MIB, protocol="rdma")
    reader = _setup(cluster, 0)  # a "standalone-store" rank gives the pool nothing
    try:
        config = ReplicateConfig()
        config.preferred_segment = writer.get_hostname()
        block, num_blocks = 8 * KIB, 8
        src = np.random.default_rng(7).integers(0, 256, 2 * num_blocks * block, dtype=np.uint8)
        dst = np.zeros_like(src)
        assert writer.register_buffer(src.ctypes.data, src.nbytes) == 0
        assert reader.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        keys = [f"vllm@{uuid.uuid4().hex}@{b}" for b in range(num_blocks)]

        def frags(base: int) -> list[list[int]]:  # (2, num_blocks, block): K then V
            return [[base + b * block, base + (num_blocks + b) * block] for b in range(8)]

        sizes = [[block, block]] * num_blocks
        missing = [i for i, e in enumerate(writer.batch_is_exist(keys)) if e != 1]
        assert missing == list(range(num_blocks))
        results = writer.batch_put_from_multi_buffers(keys, frags(src.ctypes.data), sizes, config)
        assert results == [0] * num_blocks

        halves = [list(range(0, 4)), list(range(4, 8))]

        def load(part: list[int]) -> list[int]:
            dst_frags = frags(dst.ctypes.data)
            return reader.batch_get_into_multi_buffers(
                [keys[i] for i in part], [dst_frags[i] for i in part], [sizes[i] for i in part]
            )

        with ThreadPoolExecutor(max_workers=2) as pool:
            got = [n for part in pool.map(load, halves) for n in part]
        assert got == [2 * block] * num_blocks and np.array_equal(dst, src)

        descs = reader.batch_get_replica_desc([*keys[:2], "vllm@absent"])
        assert set(descs) == set(keys[:2])
        for key in keys[:2]:
            replica = descs.get(key)[0]
            assert replica.is_memory_replica() is True
            assert replica.is_disk_replica() is False
            assert replica.is_local_disk_replica() is False
        assert descs.get("vllm@absent") is None

        assert writer.remove_all(force=True) >= num_blocks
        assert reader.batch_is_exist(keys) == [0] * num_blocks
    finally:
        for store in (writer, reader):
            assert store.close() == 0
            assert store.close() == 0


def test_vllm_store_full_pool_answers_no_available_handle(cluster) -> None:
    """vLLM's send thread treats -200 as pool pressure and skips later batches until one
    succeeds: a key that cannot fit answers -200 per key, the keys that fit 0."""
    store = _setup(cluster, 2 * MIB)
    try:
        buf = np.ones(3 * MIB, dtype=np.uint8)
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        base = buf.ctypes.data
        tag = uuid.uuid4().hex
        results = store.batch_put_from_multi_buffers(
            [f"small-{tag}", f"huge-{tag}"],
            [[base], [base, base + 2 * MIB]],
            [[64 * KIB], [2 * MIB, MIB]],
            ReplicateConfig(),
        )
        assert results == [0, NO_AVAILABLE_HANDLE]
        assert store.batch_is_exist([f"small-{tag}", f"huge-{tag}"]) == [1, 0]
        assert store.remove_all(force=True) >= 1
    finally:
        store.close()


def test_lmcache_put_parts_with_metadata_and_zero_copy_reads(cluster) -> None:
    """LMCache: setup from its JSON config's keys, register_buffer(ptr, numel) of its
    pinned CPU pool, put_parts(key, 28-byte metadata, kv bytes) read back by
    batch_get_buffer (a BufferHandle its code views with memoryview / frombuffer, None for
    a miss), put_from(key, ptr, size, config) read back by batch_get_into (bytes read > 0)
    from threads (asyncio.to_thread), is_exist 1/0, unregister_buffer 0, close."""
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", 3355443200, 64 * MIB, "tcp", "", cluster)
    assert rc == 0  # LMCache's default segment (3.1 GiB), taken only as it is written
    try:
        pool = np.zeros(256 * KIB, dtype=np.uint8)
        assert store.register_buffer(pool.ctypes.data, pool.size) == 0
        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = store.get_hostname()
        tag = uuid.uuid4().hex

        meta = bytes(range(28))
        kv = np.arange(4096, dtype=np.float32)
        assert store.put_parts(f"meta-{tag}", meta, kv.data.cast("B")) == 0
        handles = store.batch_get_buffer([f"meta-{tag}", f"absent-{tag}"])
        assert handles[1] is None
        view = memoryview(handles[0])
        assert bytes(view[:28]) == meta
        assert np.array_equal(np.frombuffer(handles[0], dtype=np.float32, offset=28), kv)

        chunk = 32 * KIB
        pool[: 4 * chunk] = np.random.default_rng(3).integers(0, 256, 4 * chunk, dtype=np.uint8)
        keys = [f"chunk-{tag}-{i}" for i in range(4)]
        for i, key in enumerate(keys):
            assert store.is_exist(key) == 0
            assert store.put_from(key, pool.ctypes.data + i * chunk, chunk, config) == 0
            assert store.is_exist(key) == 1
        out = pool.ctypes.data + 4 * chunk

        def read(i: int) -> list[int]:
            return store.batch_get_into([keys[i]], [out + i * chunk], [chunk])

        with ThreadPoolExecutor(max_workers=4) as threads:
            assert [r for rs in threads.map(read, range(4)) for r in rs] == [chunk] * 4
        assert np.array_equal(pool[4 * chunk :], pool[: 4 * chunk])
        assert store.unregister_buffer(pool.ctypes.data) == 0
    finally:
        store.close()


def test_pointer_that_is_no_memory_is_refused_not_read(cluster) -> None:
    """A consumer that passes a stale or foreign pointer (a freed pool, an address of
    another process) gets -600 from register_buffer, and the process lives on."""
    store = _setup(cluster, 4 * MIB)
    try:
        assert store.register_buffer(0x1000, 4096) == INVALID_PARAMS
        assert store.register_buffer(8, 1 << 20) == INVALID_PARAMS
        key = f"alive-{uuid.uuid4().hex}"
        assert store.put(key, b"still here") == 0 and store.get(key) == b"still here"
    finally:
        store.close()


def test_fastdeploy_keywords_and_mc_force_tcp(cluster, monkeypatch) -> None:
    """setup by upstream's keyword names (FastDeploy's call: rdma_devices=,
    master_server_addr=) under MC_FORCE_TCP with protocol "rdma" works over TCP."""
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    store = MooncakeDistributedStore()
    rc = store.setup(
        local_hostname="localhost",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=8 * MIB,
        local_buffer_size=8 * MIB,
        protocol="rdma",
        rdma_devices="",
        master_server_addr=cluster,
    )
    try:
        assert rc == 0
        key = f"fd-{uuid.uuid4().hex}"
        assert store.put(key, b"x" * 4096) == 0 and store.get(key) == b"x" * 4096
    finally:
        store.close()
