"""What the timed sections share: the model with random weights drawn on its device, a KV
cache of random content, sequences seated in a decode runner with their KV taken as
already in that cache (as after a prefill or a hand-off), so a step reads a full context,
and the bytes such a step reads.

A mixture-of-experts step reads only the experts its tokens route to. With B tokens each
choosing k distinct of E experts uniformly, an expert is chosen by none with probability
(1 - k/E)^B, so a layer reads E * (1 - (1 - k/E)^B) experts on average (`experts_touched`:
2 of Mixtral's 8 at B = 1, 7.9992 at B = 32). Random weights route roughly
uniformly (the families section counts the experts a step routes to beside this figure).
"""

from __future__ import annotations

import gc
import sys

import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.moe import Experts
from mooncake.model.params import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.spec import ModelInfo
from mooncake.model.weights import create_model

from .config import BenchConfig


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries the JSON alone)."""
    print(f"gpubench: {message}", file=sys.stderr, flush=True)


def load_model(cfg: BenchConfig, info: ModelInfo | None = None) -> Model:
    """The timed model (`info`, or the one `cfg.model_path` names): random weights drawn
    on the device (seconds, not minutes), the engine's GPU attention (Triton; its
    interpreter in --cpu-smoke)."""
    return create_model(
        info or load_model_info(cfg.model_path),
        cfg.dtype,
        cfg.device,
        attention_backend="triton",
        block_tokens=cfg.block_tokens,
        cpu_gemm="torch",  # plain parameters, whose bytes are counted below
        fill_on_device=True,
    )


def experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts `num_tokens` tokens route to, each choosing `top_k` of
    `num_experts` uniformly (see the module docstring)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def weight_bytes_per_step(model: Model, batch: int, all_experts: bool = False) -> int:
    """Weight bytes a decode step of `batch` sequences reads: every matrix once, but only
    `batch` rows of the embedding table and, of an MoE layer's experts, the expected share
    its `batch` tokens route to (every expert when `all_experts`: the dense upper bound)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_parameter("embed_tokens.weight")
    total -= (table.shape[0] - batch) * table.shape[1] * table.element_size()
    spec = model.spec
    if spec.num_experts and not all_experts:
        share = experts_touched(spec.num_experts, spec.num_experts_per_tok, batch)
        share /= spec.num_experts
        for experts in (m for m in model.modules() if isinstance(m, Experts)):
            size = sum(p.numel() * p.element_size() for p in experts.parameters())
            total -= round(size * (1 - share))
    return total


def kv_tokens_read(model: Model, seq_len: float) -> float:
    """Tokens whose K and V a step of a `seq_len`-token sequence reads: all of them, or
    the last `sliding_window` (the window counts the new token itself)."""
    window = model.spec.sliding_window
    return seq_len if window is None else min(seq_len, window)


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
    """Give the blocks of tensors dropped so far back to the device (on the CPU nothing:
    a collection there costs --cpu-smoke a tenth of a second each time, and frees little)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
