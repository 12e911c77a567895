"""The KV cache's size (roles/node/kvsize.py): the arithmetic with the numbers of real GPUs,
the warm-ups run on this CPU with the tiny model (each on a temporary cache that holds it
exactly, every block freed after), and on a GPU (marker `gpu`) a node's whole sizing."""

from __future__ import annotations

import pytest
import torch

from mooncake.config.load import load_config
from mooncake.config.settings import Config
from mooncake.config.sizes import Size
from mooncake.errors import ConfigError
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.weights import create_model
from mooncake.roles.node.kvsize import (
    KVSizing,
    cache_blocks,
    kv_cache_bytes,
    measure_gpu,
    sizing_for,
)

GIB = 1 << 30


def _config(**overrides: object) -> Config:
    return load_config(None, env={}, overrides=overrides).config


def _sizing(text: str, role: str = "decode") -> KVSizing:
    cfg = _config(**{f"{role}.kv_cache_bytes": text})
    return sizing_for(cfg, role, 16)  # type: ignore[arg-type]


def test_auto_on_a_cpu_node_is_the_old_fixed_bytes() -> None:
    """A CPU node's "auto" leaves the RAM to the pool's DRAM tier: 1 GiB prefill, 2 GiB
    decode, whatever is available; a percentage is of the available RAM, bytes are bytes."""
    free = 500 * GIB
    assert kv_cache_bytes(_sizing("auto", "prefill"), free, 0, on_gpu=False) == GIB
    assert kv_cache_bytes(_sizing("auto"), free, 0, on_gpu=False) == 2 * GIB
    assert kv_cache_bytes(_sizing("10%"), free, 0, on_gpu=False) == 50 * GIB
    assert kv_cache_bytes(_sizing("3GiB"), free, 0, on_gpu=False) == 3 * GIB


def test_on_a_gpu_a_share_is_of_what_the_weights_and_activations_leave() -> None:
    """Llama-3-8B in bf16 on an 80 GB H100: 62 GiB free after the weights and the warm-up
    (its blocks released), whose activation peak was 2 GiB: "auto" is 90% of the other
    60 GiB (54 GiB, about 442k tokens at 128 KiB a token), "50%" is 30 GiB; bytes are
    taken as they are up to the 60 GiB, and refused over it."""
    free, peak = 62 * GIB, 2 * GIB
    auto = kv_cache_bytes(_sizing("auto"), free, peak, on_gpu=True)
    assert auto == int(60 * GIB * 0.9) and auto // (128 << 10) == 442_368
    assert kv_cache_bytes(_sizing("50%"), free, peak, on_gpu=True) == 30 * GIB
    assert kv_cache_bytes(_sizing("60GiB"), free, peak, on_gpu=True) == 60 * GIB
    with pytest.raises(ConfigError, match=r"decode.kv_cache_bytes = 61GiB: more than the GPU"):
        kv_cache_bytes(_sizing("61GiB"), free, peak, on_gpu=True)
    with pytest.raises(ConfigError, match='give at most 60GiB, or a percentage, or "auto"'):
        kv_cache_bytes(_sizing("61GiB"), free, peak, on_gpu=True)


def test_a_gpu_the_weights_filled_has_no_room() -> None:
    with pytest.raises(ConfigError, match=r"prefill.kv_cache_bytes: no room for a KV cache"):
        kv_cache_bytes(_sizing("auto", "prefill"), GIB, 2 * GIB, on_gpu=True)


def test_cache_blocks_counts_whole_blocks_and_wants_two() -> None:
    block = PagedKVCache.block_bytes_per_layer(16, 8, 128, 2) * 32  # Llama-3-8B, bf16
    assert block == 2 << 20
    assert cache_blocks(54 * GIB, block, 16, "decode.kv_cache_bytes") == 27_648
    assert cache_blocks(5 << 20, block, 16, "k") == 2
    with pytest.raises(ConfigError, match=r"decode.kv_cache_bytes: .* holds 1 blocks .* 4194304"):
        cache_blocks(3 << 20, block, 16, "decode.kv_cache_bytes")


def test_each_setting_is_its_own_roles() -> None:
    cfg = _config(**{"prefill.chunk_tokens": 256, "decode.max_batch": 8})
    prefill, decode = sizing_for(cfg, "prefill", 16), sizing_for(cfg, "decode", 16)
    assert (prefill.key, prefill.warmup_tokens) == ("prefill.kv_cache_bytes", 256)
    assert (decode.key, decode.warmup_tokens) == ("decode.kv_cache_bytes", 7 * 16 + 257)
    assert prefill.size.is_auto and decode.size == Size(is_auto=True)


@pytest.mark.parametrize(
    "role,layers",
    [("prefill", (0, 2)), ("prefill", (2, 4)), ("decode", (0, 4))],
    ids=["prefill", "prefill-later-stage", "decode"],
)
def test_warm_up_runs_the_largest_batch_in_its_temporary_cache(
    role: str, layers: tuple[int, int]
) -> None:
    """The warm-up runs through the runners' public calls in a cache of exactly its
    `warmup_tokens` (a block short and it would not fit), and frees every block."""
    cfg = _config(**{"prefill.chunk_tokens": 64, "decode.max_batch": 5})
    sizing = sizing_for(cfg, role, 16)  # type: ignore[arg-type]
    model = create_model(load_model_info("dummy:tiny"), "float32", "cpu", layers)
    cache = PagedKVCache.for_model(model, -(-sizing.warmup_tokens // 16), 16)
    sizing.warmup(model, cache)
    cache.allocator.check_integrity()
    assert cache.allocator.num_free == cache.num_blocks
    short = PagedKVCache.for_model(model, cache.num_blocks - 1, 16)
    with pytest.raises(Exception, match="KV cache full|every warm-up request"):
        sizing.warmup(model, short)


@pytest.mark.gpu
def test_gpu_sizing_after_the_warm_up() -> None:
    """On a GPU: the warm-up's activation peak is measured and the free memory read after
    it; "auto" then leaves room for a step beside a 90% cache."""
    model = create_model(load_model_info("dummy:tiny"), "float32", "cuda:0")
    sizing = _sizing("auto")
    mem = measure_gpu(model, sizing, 16)
    free, total = torch.cuda.mem_get_info()
    assert 0 < mem.activation_peak_bytes < mem.free_bytes <= total
    assert abs(mem.free_bytes - free) < 64 << 20  # nothing of the warm-up stayed
    num_bytes = kv_cache_bytes(sizing, mem.free_bytes, mem.activation_peak_bytes, on_gpu=True)
    assert num_bytes == int((mem.free_bytes - mem.activation_peak_bytes) * 0.9)
