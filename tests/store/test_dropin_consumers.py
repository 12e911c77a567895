"""The Mooncake backends of SGLang, LMCache and vLLM call MooncakeDistributedStore in a few
set ways (issue 36); each way here, with a KV pool in host memory as those engines hold
it, against a master child process and two engine instances sharing the pool."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.store.dropin import MIB, client, master, secret_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]
PAGE = 64 << 10  # bytes of one KV page
NUM_PAGES = 16


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[MooncakeDistributedStore, MooncakeDistributedStore]]:
    """Two serving instances, each giving the pool 32 MiB, as SGLang's HiCache sets up."""
    with secret_env(), master() as addr:
        pair = client(addr, 32 * MIB), client(addr, 32 * MIB)
        yield pair
        for s in pair:
            s.close()


def _pool(store: MooncakeDistributedStore, seed: int) -> np.ndarray:
    """A host KV pool of NUM_PAGES pages, registered as the engines register theirs."""
    pool = np.random.default_rng(seed).integers(0, 256, NUM_PAGES * PAGE, dtype=np.uint8)
    assert store.register_buffer(pool.ctypes.data, pool.nbytes) == 0
    return pool


def test_sglang_hicache_warmup_then_pages_through_registered_pool(engines) -> None:
    """Warm-up put / is_exist / get; batch_is_exist picks the pages to write; batch_put_from
    of those; the other instance reads them with batch_get_into; the same prompt again
    stores nothing new and answers 0; remove_all empties the pool."""
    prefill, decode = engines
    warm_key, warm_value = f"warmup-{uuid.uuid4().hex}", bytes(4096)
    assert prefill.put(warm_key, warm_value) == 0
    assert prefill.is_exist(warm_key) == 1 and prefill.get(warm_key) == warm_value

    src, dst = _pool(prefill, 1), _pool(decode, 2)
    keys = [f"sglang-page-{i}" for i in range(NUM_PAGES)]
    ptrs = [src.ctypes.data + i * PAGE for i in range(NUM_PAGES)]
    exist = prefill.batch_is_exist(keys)
    assert exist == [0] * NUM_PAGES
    todo = [i for i, e in enumerate(exist) if e != 1]
    results = prefill.batch_put_from(
        [keys[i] for i in todo], [ptrs[i] for i in todo], [PAGE] * len(todo)
    )
    assert results == [0] * NUM_PAGES
    assert prefill.batch_put_from(keys, ptrs, [PAGE] * NUM_PAGES) == [0] * NUM_PAGES  # repeated

    dst_ptrs = [dst.ctypes.data + i * PAGE for i in reversed(range(NUM_PAGES))]
    assert decode.batch_get_into(keys, dst_ptrs, [PAGE] * NUM_PAGES) == [PAGE] * NUM_PAGES
    assert np.array_equal(dst.reshape(NUM_PAGES, PAGE)[::-1], src.reshape(NUM_PAGES, PAGE))
    assert decode.batch_is_exist([*keys[:2], "sglang-page-none"]) == [1, 1, 0]

    assert prefill.remove_all(force=True) >= NUM_PAGES
    assert prefill.batch_is_exist(keys) == [0] * NUM_PAGES
    for store, pool in ((prefill, src), (decode, dst)):
        assert store.unregister_buffer(pool.ctypes.data) == 0


def test_lmcache_chunks_with_replicate_config(engines) -> None:
    """LMCache's backend: put_from / get_into of chunks with a ReplicateConfig naming its
    own host as the preferred segment; is_exist before and after."""
    writer, reader = engines
    src, dst = _pool(writer, 3), _pool(reader, 4)
    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = writer.get_hostname()
    for i in range(4):
        key = f"lmcache@chunk-{i}"
        assert writer.is_exist(key) == 0
        assert writer.put_from(key, src.ctypes.data + i * PAGE, PAGE, config) == 0
        assert writer.put_from(key, src.ctypes.data + i * PAGE, PAGE, config) == 0  # repeated
        assert reader.is_exist(key) == 1
        assert reader.get_into(key, dst.ctypes.data + i * PAGE, PAGE) == PAGE
    assert np.array_equal(dst[: 4 * PAGE], src[: 4 * PAGE])
    assert reader.get_replica_desc("lmcache@chunk-0")[0].is_memory_replica()
    for store, pool in ((writer, src), (reader, dst)):
        assert store.unregister_buffer(pool.ctypes.data) == 0


def test_vllm_store_connector_layers_as_multi_buffers(engines) -> None:
    """vLLM's store connector: one key per block whose value is that block's slice of
    every layer (batch_put_from_multi_buffers), read back into another instance's layers
    (batch_get_into_multi_buffers); a repeated save answers 0 per key."""
    prefill, decode = engines
    num_layers, num_blocks, block = 4, 3, 8192
    src = [
        np.random.default_rng(i).integers(0, 256, num_blocks * block, dtype=np.uint8)
        for i in range(num_layers)
    ]
    dst = [np.zeros(num_blocks * block, dtype=np.uint8) for _ in range(num_layers)]
    for store, layers in ((prefill, src), (decode, dst)):
        for layer in layers:
            assert store.register_buffer(layer.ctypes.data, layer.nbytes) == 0
    keys = [f"vllm-block-{b}" for b in range(num_blocks)]
    config = ReplicateConfig()
    config.prefer_alloc_in_same_node = True

    def addrs(layers: list[np.ndarray]) -> list[list[int]]:
        return [[layer.ctypes.data + b * block for layer in layers] for b in range(num_blocks)]

    sizes = [[block] * num_layers for _ in range(num_blocks)]
    assert prefill.batch_put_from_multi_buffers(keys, addrs(src), sizes, config) == [0] * num_blocks
    assert prefill.batch_put_from_multi_buffers(keys, addrs(src), sizes, config) == [0] * num_blocks
    assert decode.batch_is_exist(keys) == [1] * num_blocks
    got = decode.batch_get_into_multi_buffers(keys, addrs(dst), sizes, True)
    assert got == [block * num_layers] * num_blocks
    assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
    for store, layers in ((prefill, src), (decode, dst)):
        for layer in layers:
            assert store.unregister_buffer(layer.ctypes.data) == 0
