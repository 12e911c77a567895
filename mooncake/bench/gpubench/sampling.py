"""The sampler at the decode batch's size over Llama 3's vocabulary, greedy and with
temperature and top-p; each call is the whole per-step path from float32 logits on the
device to the sampled ids on the host.

Written against the device sampler's API (`SamplingBatch.build(params, seeds, positions,
history, prompt_lens, device)`, `sample(logits, batch).to_host()`); where the tree still
has the host sampler (`sample(logits, params, generators)`, a CPU `torch.Generator` per
sampled row, as `Sequence` makes them), that one is timed instead and `api` says which.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mooncake.model.params import SamplingParams

from .bed import progress, synchronize
from .config import BenchConfig
from .limits import Limits

CASES = {"greedy": (0.0, 1.0), "temperature_top_p": (0.8, 0.95)}  # (temperature, top_p)


def _sampling_call(sampler: Any, logits: Tensor, params: list[SamplingParams]) -> Callable:
    """One step's sampling, by whichever API the sampler module has."""
    if hasattr(sampler, "SamplingBatch"):
        seeds = [p.seed or 0 for p in params]
        positions = [1000 + i for i in range(len(params))]

        def device_api() -> Any:
            batch = sampler.SamplingBatch.build(params, seeds, positions, None, None, logits.device)
            return sampler.sample(logits, batch).to_host()

        return device_api
    generators = [None if p.is_greedy else sampler.make_generator(p.seed) for p in params]
    return lambda: sampler.sample(logits, params, generators)


def run_sampling(cfg: BenchConfig, limits: Limits) -> dict[str, Any]:
    """Milliseconds per step's sampling for each case, beside one read of the logits."""
    sampler = importlib.import_module("mooncake.model.sampler")
    batch, vocab = cfg.sampler_batch, cfg.sampler_vocab
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    logits = 4 * torch.randn(batch, vocab, generator=gen, device=cfg.device)
    logits_bytes = logits.numel() * logits.element_size()
    floor_us = logits_bytes / (limits.hbm_GBps * 1e3)
    rows = []
    for name, (temperature, top_p) in CASES.items():
        params = [
            SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=i)
            for i in range(batch)
        ]
        call = _sampling_call(sampler, logits, params)
        for _ in range(2):
            call()
        times = []
        for _ in range(cfg.sampler_repeats):
            start = time.perf_counter()
            out = call()
            synchronize(cfg.device)
            times.append(time.perf_counter() - start)
        assert len(out.token_ids) == batch, (len(out.token_ids), batch)
        ms = statistics.median(times) * 1e3
        rows.append(
            {
                "case": name,
                "temperature": temperature,
                "top_p": top_p,
                "ms": ms,  # median
                "ms_min": min(times) * 1e3,
                "floor_us": floor_us,  # one read of the logits at HBM bandwidth
                "ratio_to_floor": ms * 1e3 / floor_us,
            }
        )
        progress(f"sampling {name}: {ms:.2f} ms")
    api = "device" if hasattr(sampler, "SamplingBatch") else "host (no SamplingBatch yet)"
    return {"api": api, "batch": batch, "vocab": vocab, "logits_bytes": logits_bytes, "rows": rows}
