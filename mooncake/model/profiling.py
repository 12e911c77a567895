"""`mooncake profile`: measure this node, fit the Conductor's polynomial cost model.

Samples (seconds, the median of `repeat` runs: on a shared host or a VM the best run is
the exception, and a cost model of best cases is optimistic):

- prefill time over a grid of (input_len, reused_len): prompts share one token sequence
  whose blocks sit in a DRAM pool, so a sample with reuse pays the real load and
  validation of its reused blocks, as on a prefill node;
- decode step time over (batch_size, total_context_len) from `batch_size` requests of
  `context` tokens each.

Fits are weighted least squares on the relative error (numpy), so short and long samples
count alike; the result is the Conductor's `CostModelFile` (source "profile"), written
with `CostModel.save`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from mooncake.bench.engine import Bench, random_prompt
from mooncake.conductor.costmodel import (
    COST_MODEL_VERSION,
    CostModel,
    CostModelFile,
    FitError,
    Poly2,
    Term,
)
from mooncake.errors import ConfigError
from mooncake.kv.object import DTYPE_BYTES
from mooncake.model.info import ModelInfo

log = logging.getLogger(__name__)

# prefill: the full quadratic in (input_len x, reused_len y) -- dense work per new token
# (x - y), causal attention pairs (x^2 - y^2) / 2, chunk-level attention over the reused
# prefix (x*y), loading per reused token (y). decode step: fixed + per request + per
# context token read; no squares, so it extrapolates sanely past the sampled batch sizes.
PREFILL_POWERS = ((0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2))
DECODE_POWERS = ((0, 0), (1, 0), (0, 1))


class Sample(msgspec.Struct, frozen=True):
    x: float  # input_len | batch_size
    y: float  # reused_len | total_context_len
    seconds: float


def fit_poly2(
    samples: Sequence[Sample], powers: Sequence[tuple[int, int]], variables: tuple[str, str]
) -> Poly2:
    """Least-squares polynomial with the given (i, j) terms, minimising relative error."""
    if len(samples) < len(powers):
        raise ConfigError(
            f"{len(samples)} distinct {variables} samples cannot fit {len(powers)} terms: "
            "profile more input lengths, reuse fractions, batch sizes or contexts"
        )
    x = np.array([s.x for s in samples], dtype=np.float64)
    y = np.array([s.y for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    a = np.stack([x**i * y**j for i, j in powers], axis=1)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0  # conditioning: x**2 reaches 1e8 while the constant is 1
    coef, *_ = np.linalg.lstsq(a / scale / t[:, None], np.ones_like(t), rcond=None)
    coef = coef / scale
    pred = np.maximum(a @ coef, 0.0)
    error = FitError(
        rmse_s=float(np.sqrt(np.mean((pred - t) ** 2))),
        max_rel=float(np.max(np.abs(pred - t) / t)),
        num_samples=len(samples),
    )
    terms = tuple(Term(powers=p, coef=float(c)) for p, c in zip(powers, coef, strict=True))
    return Poly2(variables=variables, terms=terms, fit_error=error)


LONG_SAMPLE_S = 2.0  # seconds of runs after which a prefill sample is not timed again


def profile_prefill(
    bench: Bench,
    input_lens: Sequence[int],
    reuse_fractions: Sequence[float],
    repeat: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Sample]:
    """Prefill seconds for each input length and block-aligned reused share of it: the
    median of `repeat` runs, or of fewer once they took `LONG_SAMPLE_S` together."""
    bt = bench.bt
    ids = random_prompt(max(input_lens), bench.vocab, seed=7)
    grid = sorted(
        {(n, min(int(n * f) // bt, (n - 1) // bt)) for n in input_lens for f in reuse_fractions}
    )
    pool = bench.pool()
    most_reused = max(blocks for _, blocks in grid) * bt
    if most_reused:  # the blocks any sample reuses, in the pool
        bench.run(bench.runner(pool, store=True), ids[:most_reused])
    runner = bench.runner(pool)
    samples: list[Sample] = []
    for n, reused_blocks in grid:  # a set: short prompts have fewer distinct block counts
        progress(f"prefill {n} tokens, {reused_blocks * bt} reused")
        runs: list[float] = []
        # NOTE: a long prefill is timed fewer times: its noise is small against its length,
        # and a real model's 4k-token prompts would otherwise take minutes on a CPU
        while len(runs) < repeat and sum(runs) < LONG_SAMPLE_S:
            result = runner.prefill(ids[:n], max_reuse_blocks=reused_blocks)
            bench.cache.free(result.block_ids)
            assert result.stats.num_reused_tokens == reused_blocks * bt, result.stats
            runs.append(result.stats.compute_s)
        samples.append(Sample(n, reused_blocks * bt, statistics.median(runs)))
    pool.close()
    return samples


def profile_decode(
    bench: Bench,
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    steps: int,
    repeat: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Sample]:
    """Decode step seconds for each batch size and per-request context length."""
    samples = []
    for b in batch_sizes:
        for ctx in contexts:
            progress(f"decode batch {b}, {ctx} tokens each")
            samples.append(Sample(b, b * ctx, bench.decode_rate(b, ctx, steps, repeat).median))
    return samples


def build_cost_model(
    bench: Bench,
    prefill: Sequence[Sample],
    decode: Sequence[Sample],
    kv_capacity_tokens: int,
    link_bytes_per_s: float,
) -> CostModel:
    """The Conductor's cost model from the samples (source "profile")."""
    spec = bench.info.spec
    device = f"cpu x{torch.get_num_threads()} thread(s), {bench.dtype}"
    return CostModel(
        CostModelFile(
            version=COST_MODEL_VERSION,
            model=spec.name,
            device=device,
            source="profile",
            kv_bytes_per_token=spec.kv_bytes_per_token(DTYPE_BYTES[bench.dtype]),
            kv_capacity_tokens=kv_capacity_tokens,
            link_bytes_per_s=link_bytes_per_s,
            prefill=fit_poly2(prefill, PREFILL_POWERS, ("input_len", "reused_len")),
            decode=fit_poly2(decode, DECODE_POWERS, ("batch_size", "context_len")),
        )
    )


def profile_cost_model(
    info: ModelInfo,
    dtype: str,
    block_tokens: int,
    chunk_tokens: int,
    input_lens: Sequence[int],
    reuse_fractions: Sequence[float],
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    decode_steps: int,
    repeat: int,
    kv_capacity_tokens: int,
    link_bytes_per_s: float,
    progress: Callable[[str], None] = lambda _: None,
    cpu_gemm: str = "onednn",
) -> tuple[CostModel, list[Sample], list[Sample]]:
    """Measure this process's prefill and decode times and fit the cost model; returns it
    with the prefill and decode samples it was fitted to."""
    bt = block_tokens
    blocks = (
        max(
            2 * -(-max(input_lens) // bt),
            max(batch_sizes) * -(-(max(contexts) + decode_steps) // bt),
        )
        + 4
    )
    bench = Bench(info, dtype, bt, chunk_tokens, blocks, cpu_gemm)
    prefill = profile_prefill(bench, input_lens, reuse_fractions, repeat, progress)
    decode = profile_decode(bench, batch_sizes, contexts, decode_steps, repeat, progress)
    model = build_cost_model(bench, prefill, decode, kv_capacity_tokens, link_bytes_per_s)
    return model, prefill, decode
