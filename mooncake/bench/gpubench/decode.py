"""Decode step time on the engine's real path, against the roofline of a step.

A step is `DecodeRunner.step()`: schedule, the forward (eager, or replayed from the CUDA
graph of the batch's bucket), sampling and its host read of the sampled ids, timed on the
host's clock around a synchronised step, after warm-up steps. Every sequence of a batch
has the same context, its KV random and "already computed" (`bed.seat`), its blocks
allocated lowest id first (so mostly consecutive). One runner per mode serves every batch
size, as in serving: graphs are captured once for every bucket up to the largest batch,
for contexts up to `max_model_len` (which fixes the kernels' cut, `cudagraph.py`).

The roofline of a step is its bytes over the HBM bandwidth: every weight once (of the
embedding table only the batch's rows; of an MoE layer's experts only those the batch is
expected to route to, `bed.experts_touched`, with the all-experts bound beside it) plus
each sequence's K and V in every layer once (under a sliding window, the window's); the
KV written, the activations and the logits are left out (under 1% at these shapes).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model

from .bed import (
    blocks_that_fit,
    experts_touched,
    kv_bytes_per_token,
    kv_tokens_read,
    progress,
    random_cache,
    release_memory,
    seat,
    synchronize,
    unseat,
    weight_bytes_per_step,
)
from .config import BenchConfig
from .limits import Limits


def step_times(runner: DecodeRunner, device: str, num_warmup: int, num_timed: int) -> list[float]:
    """Seconds of each timed step, after `num_warmup` steps (the first admits the batch)."""
    for _ in range(num_warmup):
        runner.step()
    synchronize(device)
    times = []
    for _ in range(num_timed):
        start = time.perf_counter()
        runner.step()
        synchronize(device)  # NOTE: the step's host read already waited; this is a guard
        times.append(time.perf_counter() - start)
    return times


def step_figures(
    model: Model, limits: Limits, batch: int, mean_seq_len: float, times: list[float]
) -> dict[str, Any]:
    """Time per step, tokens/s and the bytes read per second beside the HBM's; for an MoE
    model also the experts a layer is expected to read and the roofline of all of them."""
    seconds = statistics.median(times)
    weight_bytes = weight_bytes_per_step(model, batch)
    kv_bytes = int(batch * kv_tokens_read(model, mean_seq_len) * kv_bytes_per_token(model))
    gbps = (weight_bytes + kv_bytes) / seconds / 1e9
    roofline_s = (weight_bytes + kv_bytes) / (limits.hbm_GBps * 1e9)
    figures = {
        "ms_per_step": seconds * 1e3,  # median
        "ms_min": min(times) * 1e3,
        "ms_max": max(times) * 1e3,
        "tokens_per_s": batch / seconds,
        "weight_bytes": weight_bytes,  # read per step (MoE: the experts expected routed to)
        "kv_bytes": kv_bytes,  # read per step (mean over the timed steps)
        "GBps": gbps,
        "share_of_hbm": gbps / limits.hbm_GBps,
        "share_of_copy": gbps / limits.copy_GBps,
        "roofline_ms": roofline_s * 1e3,
        "roofline_ratio": seconds / roofline_s,  # 1.0 is the floor
    }
    spec = model.spec
    if spec.num_experts:
        dense_bytes = weight_bytes_per_step(model, batch, all_experts=True)
        dense_s = (dense_bytes + kv_bytes) / (limits.hbm_GBps * 1e9)
        figures.update(
            # per MoE layer, uniform routing: E * (1 - (1 - k/E)^B)
            experts_touched=experts_touched(spec.num_experts, spec.num_experts_per_tok, batch),
            weight_bytes_all_experts=dense_bytes,  # the dense upper bound
            roofline_ms_all_experts=dense_s * 1e3,
            roofline_ratio_all_experts=seconds / dense_s,
        )
    return figures


def time_case(
    cfg: BenchConfig, model: Model, limits: Limits, runner: DecodeRunner, batch: int, context: int
) -> dict[str, Any]:
    """The figures of `batch` sequences of `context` tokens, or {"error": ...}; the
    runner is left empty either way."""
    try:
        num_steps = cfg.warmup_steps + cfg.timed_steps
        seat(runner, batch, context, num_steps, seed=batch * 7919 + context)
        times = step_times(runner, cfg.device, cfg.warmup_steps, cfg.timed_steps)
        assert len(runner.running) == batch, (len(runner.running), batch)
    except Exception as e:  # one case's failure (out of memory, say) leaves the others
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        unseat(runner)
        release_memory(cfg.device)
    mean_len = context + cfg.warmup_steps + (cfg.timed_steps - 1) / 2
    return step_figures(model, limits, batch, mean_len, times)


def runner_len(cfg: BenchConfig, context: int) -> int:
    """The runner's `max_model_len` for `context` tokens and the run's steps after them,
    in whole blocks (it fixes the kernels' cut of a captured graph)."""
    num_steps = cfg.warmup_steps + cfg.timed_steps
    return -(-(context + num_steps + 1) // cfg.block_tokens) * cfg.block_tokens


def time_modes(
    cfg: BenchConfig,
    model: Model,
    limits: Limits,
    cache: PagedKVCache,
    cases: list[tuple[int, int]],
    skipped: dict[tuple[int, int], str],
    label: str = "decode",
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each (batch, context) of `cases` eager and (on a GPU) with CUDA graphs, one runner
    per mode (cases in `skipped` are rows saying why); the rows, and each mode's runner
    construction in seconds (graph capture of every bucket)."""
    max_len = runner_len(cfg, max(c for _, c in cases))
    rows: list[dict[str, Any]] = []
    setup_s: dict[str, float] = {}
    for graphs in (False, True) if cfg.is_gpu else (False,):
        mode = "graphs" if graphs else "eager"
        start = time.perf_counter()
        try:
            runner: DecodeRunner | None = DecodeRunner(
                model,
                cache,
                max_batch=max(b for b, _ in cases),
                cuda_graphs=graphs,
                max_model_len=max_len,
            )
            setup_error = None
        except Exception as e:  # NOTE: the eager rows stay; this mode's cases say why
            runner, setup_error = None, f"{type(e).__name__}: {e}"
        setup_s[mode] = time.perf_counter() - start
        for batch, context in cases:
            row: dict[str, Any] = {"batch": batch, "context": context, "cuda_graphs": graphs}
            if runner is None:
                rows.append({**row, "error": f"runner: {setup_error}"})
            elif (batch, context) in skipped:
                rows.append({**row, "skipped": skipped[(batch, context)]})
            else:
                row.update(time_case(cfg, model, limits, runner, batch, context))
                rows.append(row)
                said = f"{row['ms_per_step']:.2f} ms" if "error" not in row else row["error"]
                progress(f"{label} {mode} B={batch} ctx={context}: {said}")
        del runner
        release_memory(cfg.device)
    return rows, setup_s


def run_decode(cfg: BenchConfig, model: Model, limits: Limits) -> dict[str, Any]:
    """Every (batch, context) of the config, eager and (on a GPU) with CUDA graphs."""
    bt, num_steps = cfg.block_tokens, cfg.warmup_steps + cfg.timed_steps
    cases = [(b, c) for b in cfg.decode_batches for c in cfg.decode_contexts]
    need = {(b, c): b * -(-(c + num_steps + 1) // bt) for b, c in cases}  # KV blocks
    fit = blocks_that_fit(model, bt, 0.8)  # the rest: CUDA graphs' pool, activations
    skipped = {
        case: f"needs {need[case] * bt * kv_bytes_per_token(model) / 1e9:.1f} GB of KV, "
        "more than 80% of free"
        for case in cases
        if fit is not None and need[case] > fit
    }
    if len(skipped) == len(cases):
        raise RuntimeError(f"no decode case fits in {fit} KV blocks: {need}")
    cache = random_cache(model, max(need[case] for case in cases if case not in skipped), bt)
    if cfg.is_gpu:
        torch.cuda.reset_peak_memory_stats()
    rows, setup_s = time_modes(cfg, model, limits, cache, cases, skipped)
    del cache
    release_memory(cfg.device)
    return {
        "block_tokens": bt,
        "max_model_len": runner_len(cfg, max(cfg.decode_contexts)),
        "setup_s": setup_s,  # the runner's construction: graph capture of every bucket
        # the weights, the cache and the graphs' pool: the run's peak but for kvsize's
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cfg.is_gpu else None,
        "rows": rows,
    }
