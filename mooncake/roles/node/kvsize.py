"""How many KV blocks a prefill or decode node's paged cache gets (`prefill/decode.kv_cache_bytes`).

On a CPU node the configured bytes, or a percentage of the available RAM; "auto" is fixed
bytes there (`PREFILL_CPU_KV_BYTES`, `DECODE_CPU_KV_BYTES`), since the host's RAM also
holds the pool's DRAM tier. On a GPU the cache is sized after the model is loaded and a
warm-up ran at the largest batch the node runs, on a small temporary cache:

    prefill   one chunk of prefill.chunk_tokens through this stage's layers
    decode    one step of decode.max_batch requests, one of them prefilled locally first
              (a chunk of prefill.chunk_tokens, as a preempted request is)

then torch's cached blocks go back to the driver and

    budget = free (torch.cuda.mem_get_info) - activation peak of the warm-up
             (max_memory_allocated during it - what was allocated before it)

is what a percentage (and "auto": `AUTO_KV_GPU_SHARE`) is of, so the next real step's
activations still fit beside the cache. Explicit bytes over the budget are refused.
`kv_cache_bytes` and `cache_blocks` are the arithmetic (pure); `measure_gpu` is the CUDA
path. NOTE: the CUDA path (`measure_gpu`) has not run on a GPU yet; the warm-ups run here
on the CPU in the tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mooncake.config.roles import AUTO_KV_GPU_SHARE, DECODE_CPU_KV_BYTES, PREFILL_CPU_KV_BYTES
from mooncake.config.settings import Config
from mooncake.config.sizes import Size, format_size
from mooncake.errors import ConfigError
from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.params import SamplingParams
from mooncake.model.prefill import PrefillRunner
from mooncake.model.sequence import Sequence

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class DeviceMemory:
    """What the warm-up left on the GPU."""

    free_bytes: int  # free on the device after the warm-up, torch's cached blocks released
    activation_peak_bytes: int  # the warm-up's peak above what was allocated before it


@dataclass(frozen=True)
class KVSizing:
    """One role's cache setting and its warm-up."""

    key: str  # "decode.kv_cache_bytes", for messages
    size: Size
    cpu_auto_bytes: int  # what "auto" is on a CPU node
    warmup: Callable[[Model, PagedKVCache], None]  # the largest batch, on a temporary cache
    warmup_tokens: int  # tokens of KV the warm-up's temporary cache holds


def sizing_for(cfg: Config, role: Role, block_tokens: int) -> KVSizing:
    """The cache setting and warm-up of a prefill or decode node."""
    chunk = cfg.prefill.chunk_tokens
    if role == "prefill":
        return KVSizing(
            "prefill.kv_cache_bytes",
            cfg.prefill.kv_cache_bytes,
            PREFILL_CPU_KV_BYTES,
            lambda model, cache: warm_up_prefill(model, cache, chunk),
            chunk,  # one chunk
        )
    batch = cfg.decode.max_batch
    return KVSizing(
        "decode.kv_cache_bytes",
        cfg.decode.kv_cache_bytes,
        DECODE_CPU_KV_BYTES,
        lambda model, cache: warm_up_decode(model, cache, batch, chunk),
        (batch - 1) * block_tokens + chunk + 1,  # a block per request, the prefilled one's
    )


def kv_cache_bytes(
    sizing: KVSizing, free_bytes: int, activation_peak_bytes: int, on_gpu: bool
) -> int:
    """Bytes of KV cache (pure): on a CPU node `free_bytes` is the available RAM and
    `activation_peak_bytes` 0; on a GPU both come from the warm-up (`measure_gpu`). Raises
    ConfigError, naming the key, when a GPU has no room for the cache."""
    size = sizing.size
    if not on_gpu:
        return sizing.cpu_auto_bytes if size.is_auto else size.resolve(free_bytes)
    budget = free_bytes - activation_peak_bytes
    what = (
        f"{format_size(free_bytes)} free on the GPU after the weights and the warm-up, "
        f"{format_size(activation_peak_bytes)} of it kept for activations"
    )
    if budget <= 0:
        raise ConfigError(
            f"{sizing.key}: no room for a KV cache ({what}): use a GPU with more memory, "
            "more pipeline stages (prefill.pipeline_group_size) or a smaller "
            "prefill.chunk_tokens / decode.max_batch"
        )
    if size.is_auto:
        return int(budget * AUTO_KV_GPU_SHARE)
    num_bytes = size.resolve(budget)
    if num_bytes > budget:
        raise ConfigError(
            f"{sizing.key} = {size}: more than the GPU holds ({what}): give at most "
            f'{format_size(budget)}, or a percentage, or "auto"'
        )
    return num_bytes


def cache_blocks(num_bytes: int, block_bytes: int, block_tokens: int, key: str) -> int:
    """How many blocks of `block_bytes` (one block of every layer of this node) fit in
    `num_bytes` (pure); raises ConfigError naming `key` when fewer than 2 do."""
    blocks = num_bytes // block_bytes
    if blocks < 2:
        raise ConfigError(
            f"{key}: a KV cache of {num_bytes} bytes holds {blocks} blocks of {block_tokens} "
            f"tokens; give at least {2 * block_bytes} bytes"
        )
    return blocks


# -- the warm-ups (any device) and the measure around them (CUDA) ---------------------------


def warm_up_prefill(model: Model, cache: PagedKVCache, chunk_tokens: int) -> None:
    """One chunk of `chunk_tokens` through `model`'s layers (a later stage gets zero
    activations, as from host memory); its blocks are freed again."""
    runner = PrefillRunner(model, cache, chunk_tokens=chunk_tokens)
    st = runner.start([i % model.spec.vocab_size for i in range(chunk_tokens)])
    hidden = None
    if not model.is_first:
        dtype = next(model.parameters()).dtype
        hidden = torch.zeros(chunk_tokens, model.spec.hidden_size, dtype=dtype)
    try:
        runner.run_chunk(st, 0, chunk_tokens, hidden)
    finally:
        runner.abort(st)  # NOTE: nothing to keep: frees its blocks, commits nothing


def warm_up_decode(model: Model, cache: PagedKVCache, max_batch: int, chunk_tokens: int) -> None:
    """One decode step of `max_batch` requests, one of them prefilled locally first (a
    chunk of `chunk_tokens`); every request ends after it, freeing its blocks."""
    # NOTE: eager: graphs captured here would hold this temporary cache's addresses
    runner = DecodeRunner(
        model, cache, max_batch=max_batch, chunk_tokens=chunk_tokens, cuda_graphs=False
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = model.spec.vocab_size
    runner.add(Sequence(0, [i % vocab for i in range(chunk_tokens + 1)], params))
    for seq_id in range(1, max_batch):
        runner.add(Sequence(seq_id, [seq_id % vocab], params))
    runner.step()
    assert not runner.has_work, "every warm-up request ends after one token"


def measure_gpu(
    model: Model,
    sizing: KVSizing,
    block_tokens: int,
    resize: Callable[[int], None] | None = None,
) -> DeviceMemory:
    """Run `sizing`'s warm-up on a temporary cache on `model`'s GPU, then release torch's
    cached blocks and read what is free. `resize`: tensor parallelism's other ranks build
    a temporary cache of as many blocks for the warm-up (and free it after). NOTE: has not
    run on a GPU yet."""
    device = next(model.parameters()).device
    num_blocks = -(-sizing.warmup_tokens // block_tokens)
    cache = PagedKVCache.for_model(model, num_blocks, block_tokens)
    if resize is not None:
        resize(num_blocks)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    sizing.warmup(model, cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    if resize is not None:
        resize(0)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    log.info(
        "warm-up on %s: activation peak %s, %s free after it",
        device,
        format_size(peak),
        format_size(free),
    )
    return DeviceMemory(free, peak)
