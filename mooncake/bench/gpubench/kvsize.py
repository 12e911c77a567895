"""`kv_cache_bytes = "90%"`, measured: the KV cache sized from the memory left after the
weights and a warm-up, then used at the largest batch and the longest prefill.

1. warm-up on a small cache: one decode step at the largest batch and one prefill of
   `kv_prefill_len` tokens; the activation peak is what the device allocated above the
   weights and that cache;
2. the small cache freed, `torch.cuda.mem_get_info()`: the KV cache gets
   `kv_fraction` of the free bytes less that peak, in whole blocks;
3. in that cache, a decode step at the largest batch (with the engine's default: CUDA
   graphs on a GPU) and the prefill again, without running out of memory;
4. the cache freed.
On the CPU (`--cpu-smoke`) `cpu_free_bytes` stands in for the free memory.
"""

from __future__ import annotations

from typing import Any

import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.prefill import PrefillRunner

from .bed import kv_bytes_per_token, progress, random_cache, release_memory, seat, unseat
from .config import BenchConfig


def exercise(cache: PagedKVCache, model: Model, cfg: BenchConfig, cuda_graphs: bool | None) -> None:
    """A decode step at the largest batch, then a prefill of kv_prefill_len, in `cache`."""
    batch, context = max(cfg.decode_batches), cfg.kv_decode_context
    runner = DecodeRunner(
        model, cache, max_batch=batch, cuda_graphs=cuda_graphs, max_model_len=context + 64
    )
    seat(runner, batch, context, 2, seed=3)
    runner.step()
    assert len(runner.running) == batch, (len(runner.running), batch)
    unseat(runner)
    del runner
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(model.spec.vocab_size, (cfg.kv_prefill_len,), generator=gen).tolist()
    blocks = cache.allocate(len(tokens))
    PrefillRunner(model, cache).prefill(tokens, block_ids=blocks)
    cache.free(blocks)


def run_kvsize(cfg: BenchConfig, model: Model) -> dict[str, Any]:
    """The cache's blocks and bytes, the memory before and after, and that it ran."""
    bt, is_gpu = cfg.block_tokens, cfg.is_gpu
    block_bytes = bt * kv_bytes_per_token(model)
    batch = max(cfg.decode_batches)
    warm_blocks = batch * -(-(cfg.kv_decode_context + 3) // bt) + -(-cfg.kv_prefill_len // bt)
    release_memory(cfg.device)
    warm = random_cache(model, warm_blocks, bt)
    if is_gpu:
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if is_gpu else 0
    exercise(warm, model, cfg, cuda_graphs=False)
    activation_peak = torch.cuda.max_memory_allocated() - held if is_gpu else 0
    del warm
    release_memory(cfg.device)
    free, total = torch.cuda.mem_get_info() if is_gpu else (cfg.cpu_free_bytes, 0)
    num_blocks = int(cfg.kv_fraction * free - activation_peak) // block_bytes
    progress(f"kvsize: {num_blocks} blocks of {block_bytes} bytes in {free / 1e9:.1f} GB free")
    cache = random_cache(model, num_blocks, bt)
    free_after_alloc = torch.cuda.mem_get_info()[0] if is_gpu else None
    exercise(cache, model, cfg, cuda_graphs=None)
    out = {
        "kv_fraction": cfg.kv_fraction,
        "free_bytes": free,  # after the weights, before the cache
        "free_bytes_source": "torch.cuda.mem_get_info" if is_gpu else "cpu_free_bytes",
        "total_bytes": total,
        "activation_peak_bytes": activation_peak,  # of the warm-up
        "num_blocks": num_blocks,
        "block_tokens": bt,
        "kv_bytes": num_blocks * block_bytes,
        "num_tokens": num_blocks * bt,
        "free_bytes_with_cache": free_after_alloc,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if is_gpu else None,
        "decode_batch": batch,
        "decode_context": cfg.kv_decode_context,
        "prefill_tokens": cfg.kv_prefill_len,
        "ran": True,  # the step and the prefill, without running out of memory
    }
    del cache
    release_memory(cfg.device)
    return out
