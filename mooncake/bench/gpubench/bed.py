"""What the timed sections share: the model with random weights drawn on its device, a KV
cache of random content, and sequences seated in a decode runner with their KV taken as
already in that cache (as after a prefill or a hand-off), so a step reads a full context."""

from __future__ import annotations

import gc
import sys

import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.params import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.weights import create_model

from .config import BenchConfig


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries the JSON alone)."""
    print(f"gpubench: {message}", file=sys.stderr, flush=True)


def load_model(cfg: BenchConfig) -> Model:
    """The timed model: random weights drawn on the device (seconds, not minutes), the
    engine's GPU attention (Triton; its interpreter in --cpu-smoke)."""
    return create_model(
        load_model_info(cfg.model_path),
        cfg.dtype,
        cfg.device,
        attention_backend="triton",
        block_tokens=cfg.block_tokens,
        cpu_gemm="torch",  # plain parameters, whose bytes are counted below
        fill_on_device=True,
    )


def weight_bytes_per_step(model: Model, batch: int) -> int:
    """Weight bytes a decode step reads: every matrix once, but only `batch` rows of the
    embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_parameter("embed_tokens.weight")
    return total - (table.shape[0] - batch) * table.shape[1] * table.element_size()


def kv_bytes_per_token(model: Model) -> int:
    """K and V bytes of one token in every layer, in the model's dtype."""
    return model.spec.kv_bytes_per_token(next(model.parameters()).element_size())


def random_cache(model: Model, num_blocks: int, block_tokens: int) -> PagedKVCache:
    """A cache of `num_blocks` blocks holding random K and V (never time on zeros)."""
    cache = PagedKVCache.for_model(model, num_blocks, block_tokens)
    gen = torch.Generator(device=cache.k[0].device).manual_seed(0)
    for t in (*cache.k, *cache.v):
        t.normal_(generator=gen)
    return cache


def blocks_that_fit(model: Model, block_tokens: int, fraction: float) -> int | None:
    """KV blocks in `fraction` of the device memory free now; None on the CPU (no limit)."""
    if model.inv_freq.device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return int(fraction * free) // (block_tokens * kv_bytes_per_token(model))


def seat(runner: DecodeRunner, batch: int, context: int, num_steps: int, seed: int) -> None:
    """Queue `batch` greedy sequences of `context` random tokens whose KV (the cache's
    random content) counts as computed, each with blocks for `num_steps` steps more; the
    runner's next step admits them without a prefill."""
    cache, vocab = runner.cache, runner.model.spec.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab, (batch, context), generator=gen).tolist()
    params = SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        ids = cache.allocate(context + num_steps + 1)
        runner.add(Sequence(i, prompt, params, block_ids=ids, num_cached_tokens=context - 1))


def unseat(runner: DecodeRunner) -> None:
    """End every sequence of the runner, freeing its blocks."""
    for seq in [*runner.running, *runner.waiting]:
        runner.abort(seq.seq_id)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release_memory(device: str) -> None:
    """Give the blocks of tensors dropped so far back to the device."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
