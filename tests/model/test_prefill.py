"""Prefill: prefix reuse is exact, bad cached blocks are never used, stores are complete."""

from __future__ import annotations

import pytest
import torch

from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.layerio import DramKVPool
from mooncake.kv.object import KVObjectBuilder, decode_kv_object
from mooncake.model.kvcache import CacheFullError, PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.prefill import PrefillRunner
from tests.model.conftest import BLOCK, prompt

SECRET = b"engine-test-secret"


def _runners(model: Model, cache: PagedKVCache, fingerprint: bytes, chunk: int = 16):
    hasher = PrefixHasher(BLOCK, SECRET, fingerprint)
    plain = PrefillRunner(model, cache, chunk_tokens=chunk)
    pool = DramKVPool(plain.layout, fingerprint)
    pooled = PrefillRunner(
        model,
        cache,
        chunk_tokens=chunk,
        hasher=hasher,
        source=pool,
        sink=pool,
        fingerprint=fingerprint,
    )
    return plain, pooled, pool, hasher


@pytest.mark.parametrize("chunk", [8, 12, 64])
def test_reusing_cached_blocks_gives_the_same_logits_as_a_full_prefill(
    tiny, cache, fingerprint, chunk
):
    """A prompt whose first k blocks come from the pool yields the full prefill's logits
    and KV, for chunk sizes below, off and above the block size."""
    plain, pooled, pool, _ = _runners(tiny, cache, fingerprint, chunk)
    ids = prompt(45)
    full = plain.prefill(ids)
    first = pooled.prefill(ids[:27])  # stores blocks 0-2 (24 tokens)
    assert first.stats.num_stored_blocks == 3 and pool.num_objects == 3
    reused = pooled.prefill(ids)
    assert reused.stats.num_reused_tokens == 24
    torch.testing.assert_close(reused.logits, full.logits, atol=1e-5, rtol=1e-5)
    for layer in tiny.layer_ids:
        for a, b in zip(
            cache.gather(layer, full.block_ids, 45),
            cache.gather(layer, reused.block_ids, 45),
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for r in (full, first, reused):
        cache.free(r.block_ids)
    cache.allocator.check_integrity()


def test_a_wrong_token_in_a_cached_block_is_detected_and_recomputed(tiny, cache, fingerprint):
    """An object stored under the right block hash but holding other tokens (a hash
    collision) is rejected; reuse stops before it and the logits are still exact."""
    plain, pooled, pool, hasher = _runners(tiny, cache, fingerprint)
    ids = prompt(40)
    full = plain.prefill(ids)
    cache.free(pooled.prefill(ids).block_ids)  # stores blocks 0-3
    hashes = hasher.hash_blocks(ids)
    wrong = list(ids[BLOCK : 2 * BLOCK])
    wrong[3] += 1
    forged = KVObjectBuilder(pooled.layout, fingerprint, hashes[1], wrong)
    good = decode_kv_object(pool.get(hashes[1]), pooled.layout, fingerprint)
    forged.buf[pooled.layout.payload_offset :] = good.data[pooled.layout.payload_offset :]
    forged._missing.clear()
    pool.insert([(hashes[1], forged.commit())])

    result = pooled.prefill(ids)
    assert result.stats.num_reused_tokens == BLOCK  # block 0 only
    assert result.stats.num_rejected_blocks == 1
    torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)
    assert decode_kv_object(
        pool.get(hashes[1]), pooled.layout, fingerprint, token_ids=ids[BLOCK : 2 * BLOCK]
    )


def test_a_corrupted_cached_block_is_recomputed(tiny, cache, fingerprint):
    """A flipped payload byte fails the checksum: that block is recomputed, never used."""
    plain, pooled, pool, hasher = _runners(tiny, cache, fingerprint)
    ids = prompt(33, seed=3)
    full = plain.prefill(ids)
    cache.free(pooled.prefill(ids).block_ids)
    obj = pool.get(hasher.hash_blocks(ids)[2])
    assert obj is not None
    obj[-1] ^= 0x40
    result = pooled.prefill(ids)
    assert (result.stats.num_reused_tokens, result.stats.num_rejected_blocks) == (2 * BLOCK, 1)
    torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)


def test_layerwise_store_writes_each_block_as_the_cache_holds_it(tiny, cache, fingerprint):
    """Every full block is committed once with all layers equal to the cache's KV; the
    partial tail block is not stored."""
    _, pooled, pool, hasher = _runners(tiny, cache, fingerprint, chunk=12)
    ids = prompt(30, seed=5)
    result = pooled.prefill(ids)
    assert result.stats.num_stored_blocks == 3 and pool.num_objects == 3
    lay = pooled.layout
    for b, h in enumerate(hasher.hash_blocks(ids)):
        obj = decode_kv_object(
            pool.get(h), lay, fingerprint, block_hash=h, token_ids=ids[b * BLOCK : (b + 1) * BLOCK]
        )
        for layer in tiny.layer_ids:
            k, v = cache.layer(layer)
            block = result.block_ids[b]
            assert (
                bytes(obj.data[lay.k_offset(layer) : lay.v_offset(layer)])
                == k[block].numpy().tobytes()
            )
            assert (
                bytes(obj.data[lay.v_offset(layer) : lay.v_offset(layer) + lay.half_bytes])
                == v[block].numpy().tobytes()
            )


def test_a_prompt_that_does_not_fit_the_cache_raises_and_leaks_nothing(tiny, fingerprint):
    small = PagedKVCache.for_model(tiny, num_blocks=2, block_tokens=BLOCK)
    _, pooled, _, _ = _runners(tiny, small, fingerprint)
    with pytest.raises(CacheFullError, match="KV cache full"):
        pooled.prefill(prompt(17))
    assert small.allocator.num_free == 2


def test_scattered_blocks_give_the_same_logits_as_consecutive_ones(tiny, cache):
    """Attention reads consecutive blocks in place and gathers scattered ones: same result."""
    runner = PrefillRunner(tiny, cache, chunk_tokens=16)
    ids = prompt(40, seed=9)
    consecutive = runner.prefill(ids)
    scattered = runner.prefill(ids, block_ids=[30, 7, 21, 12, 40])
    torch.testing.assert_close(scattered.logits, consecutive.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_reused_kv_loads_each_tensor_parallel_rank_its_heads(tiny, cache, fingerprint, ranks):
    """Pool objects (every head, whatever degree wrote them) load into each rank's cache
    as that rank's heads (split over 2 ranks, replicated over 4): kv/heads.py."""
    from mooncake.kv.heads import HeadShards, rank_heads
    from mooncake.kv.layerio import LayerLoader

    _, pooled, pool, hasher = _runners(tiny, cache, fingerprint)
    ids = prompt(27)
    stored = pooled.prefill(ids)  # stores blocks 0-2
    hashes = hasher.hash_blocks(ids)[:3]
    objects = [
        decode_kv_object(pool.get(h), pooled.layout, fingerprint, block_hash=h, token_ids=t)
        for h, t in zip(hashes, [ids[i * BLOCK : (i + 1) * BLOCK] for i in range(3)], strict=True)
    ]
    shards = HeadShards(tiny.spec.num_kv_heads, ranks)
    layers = (tiny.first_layer, tiny.end_layer)
    caches = [
        PagedKVCache(8, BLOCK, shards.local, tiny.spec.head_dim, layers) for _ in range(ranks)
    ]
    loader = LayerLoader(caches, objects, [5, 2, 7], tiny.layer_ids)
    loader.join()
    for layer in tiny.layer_ids:
        for half in (0, 1):
            whole = cache.layer(layer)[half]
            for r, c in enumerate(caches):
                for i, b in enumerate([5, 2, 7]):
                    want = rank_heads(whole[stored.block_ids[i]], shards, r)
                    assert torch.equal(c.layer(layer)[half][b], want), (layer, half, r, i)
    cache.free(stored.block_ids)
