"""Prefill time (TTFT without queueing or sampling), TFLOP/s and MFU, and peak memory.

Each prompt is prefilled whole, and again with its first half reused: that half is
prefilled first (untimed) into the same blocks, then `PrefillRunner.prefill(tokens,
block_ids=..., num_cached_tokens=half)` computes the rest, as after a prefix-cache hit.
FLOPs are `ModelSpec.prefill_flops` of the tokens computed (the dense layers, 2 per
multiply-add, and causal attention's QK^T and PV; not the LM head's one row); MFU is
over the GPU's dense bf16 peak. Each case runs once untimed (compiling its kernels),
then `prefill_repeats` times; the median is reported. Peak memory is
`torch.cuda.max_memory_allocated` during the timed runs, in all and above what was held
before (the weights and the KV cache: the activations' share).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from mooncake.model.llama import Model
from mooncake.model.prefill import PrefillRunner

from .bed import progress, random_cache, release_memory, synchronize
from .config import BenchConfig
from .limits import Limits


def time_prefill(
    runner: PrefillRunner, tokens: list[int], reused: int, device: str, num_runs: int
) -> tuple[list[float], int | None, int | None]:
    """Seconds of each run after an untimed one, the peak bytes allocated in all and
    above the bytes held before (None on the CPU)."""
    times = []
    peak = held = None
    for i in range(1 + num_runs):
        blocks = runner.cache.allocate(len(tokens))
        if reused:
            runner.prefill(tokens[:reused], block_ids=blocks)
        synchronize(device)
        if device == "cuda" and i == 1:
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        start = time.perf_counter()
        runner.prefill(tokens, block_ids=blocks, num_cached_tokens=reused)
        synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
        runner.cache.free(blocks)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    return times, peak, None if peak is None or held is None else peak - held


def run_prefill(cfg: BenchConfig, model: Model, limits: Limits) -> dict[str, Any]:
    """Every prompt length x (no reuse, half reused) x chunk size of the config."""
    spec, bt = model.spec, cfg.block_tokens
    cache = random_cache(model, -(-max(cfg.prefill_lens) // bt), bt)
    gen = torch.Generator().manual_seed(2)
    rows = []
    for chunk in cfg.prefill_chunks:
        runner = PrefillRunner(model, cache, chunk_tokens=chunk)
        for n in cfg.prefill_lens:
            tokens = torch.randint(spec.vocab_size, (n,), generator=gen).tolist()
            for reused in (0, n // 2):
                times, peak, above = time_prefill(
                    runner, tokens, reused, cfg.device, cfg.prefill_repeats
                )
                seconds = statistics.median(times)
                flops = spec.prefill_flops(n, reused)
                tflops = flops / seconds / 1e12
                peak_tflops = limits.bf16_TFLOPs
                rows.append(
                    {
                        "tokens": n,
                        "reused": reused,
                        "chunk_tokens": chunk,
                        "ttft_s": seconds,  # median
                        "ttft_s_min": min(times),
                        "flops": flops,
                        "TFLOPs": tflops,
                        "mfu": None if peak_tflops is None else tflops / peak_tflops,
                        "peak_memory_bytes": peak,
                        "activation_peak_bytes": above,
                    }
                )
                progress(f"prefill {n} reused {reused} chunk {chunk}: {seconds * 1e3:.1f} ms")
        del runner
    del cache
    release_memory(cfg.device)
    return {"block_tokens": bt, "default_chunk_tokens": cfg.prefill_chunks[0], "rows": rows}
