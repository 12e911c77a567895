"""The sampler at the decode batch's size over Llama 3's vocabulary, greedy and with
temperature and top-p; each call is the whole per-step path from float32 logits on the
device to the sampled ids on the host (`SamplingBatch.build`, `sample`, `to_host`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mooncake.model.params import SamplingParams
from mooncake.model.sampler import SamplingBatch, sample

from .bed import progress, synchronize
from .config import BenchConfig
from .limits import Limits

CASES = {"greedy": (0.0, 1.0), "temperature_top_p": (0.8, 0.95)}  # (temperature, top_p)


def _sampling_call(logits: Tensor, params: list[SamplingParams]) -> Callable[[], Any]:
    """One step's sampling: the batch's tensors built and uploaded, drawn, fetched."""
    seeds = [p.seed or 0 for p in params]
    positions = [1000 + i for i in range(len(params))]

    def call() -> Any:
        batch = SamplingBatch.build(params, seeds, positions, None, None, logits.device)
        return sample(logits, batch).to_host()

    return call


def run_sampling(cfg: BenchConfig, limits: Limits) -> dict[str, Any]:
    """Milliseconds per step's sampling for each case, beside one read of the logits."""
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
        call = _sampling_call(logits, params)
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
    return {"batch": batch, "vocab": vocab, "logits_bytes": logits_bytes, "rows": rows}
