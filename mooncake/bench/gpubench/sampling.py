"""The sampler at the decode batch's size over Llama 3's vocabulary, greedy, with
temperature and top-p, and with those plus a 50-token logit_bias and min_tokens masking
EOS on every row; each call is the whole per-step path from float32 logits on the device to
the sampled ids on the host (`SamplingBatch.build`, `sample`, `to_host`).
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

# (temperature, top_p, with a logit_bias and min_tokens)
CASES = {
    "greedy": (0.0, 1.0, False),
    "temperature_top_p": (0.8, 0.95, False),
    "temperature_top_p_bias_min_tokens": (0.8, 0.95, True),
}
NUM_BIASED = 50  # tokens each row biases in the last case
EOS_ID = 2  # what min_tokens masks in the last case (any id)


def _sampling_call(
    logits: Tensor, params: list[SamplingParams], is_biased: bool = False
) -> Callable[[], Any]:
    """One step's sampling: the batch's tensors built and uploaded, drawn, fetched."""
    seeds = [p.seed or 0 for p in params]
    positions = [1000 + i for i in range(len(params))]
    stops = [(EOS_ID,)] * len(params) if is_biased else None

    def call() -> Any:
        batch = SamplingBatch.build(
            params, seeds, positions, None, None, logits.device, min_tokens_stops=stops
        )
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
    for name, (temperature, top_p, is_biased) in CASES.items():
        bias = tuple((t * (vocab // NUM_BIASED), 5.0) for t in range(NUM_BIASED))
        params = [
            SamplingParams(
                max_tokens=16,
                temperature=temperature,
                top_p=top_p,
                seed=i,
                logit_bias=bias if is_biased else (),
                min_tokens=8 if is_biased else 0,
            )
            for i in range(batch)
        ]
        call = _sampling_call(logits, params, is_biased)
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
