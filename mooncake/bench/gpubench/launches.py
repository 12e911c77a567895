"""Kernel launches and host syncs of one decode step, eager and replayed from CUDA graphs.

Three witnesses, each in its own step after warm-up steps:

- a `torch.profiler` trace of one step: `kernels` are the CUDA kernel activities in it
  (CUPTI records each kernel, those a graph replay runs too; memcpy and memset apart);
  `host_launches` and `host_syncs` are the CUDA runtime and driver calls the host made
  inside the step that launch work (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch...)
  or wait for the device (cudaStreamSynchronize, cudaEventSynchronize,
  cudaDeviceSynchronize, a blocking cudaMemcpy), by name. `host_syncs` is the figure the
  verdict reads.
- `torch.cuda.set_sync_debug_mode("warn")`: the warnings torch's own synchronising calls
  raise in one step (an event's wait is not among them).
- `bench/stepops.py`'s counter: the aten ops dispatched and the host reads of device
  values (`.tolist()`, `.item()`...), as it counts them on a CPU.
On the CPU (`--cpu-smoke`) only the last means anything; the others are null.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mooncake.bench.stepops import count
from mooncake.model.decode import DecodeRunner
from mooncake.model.llama import Model

from .bed import progress, random_cache, release_memory, seat, synchronize, unseat
from .config import BenchConfig

LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
        "cuGraphLaunch",
    }
)
SYNC_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaDeviceSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cuCtxSynchronize",
        "cudaMemcpy",  # the blocking copy; cudaMemcpyAsync does not wait
    }
)
STEP_LABEL = "gpubench.decode_step"
HOW = (
    "kernels: CUDA kernel activities in a torch.profiler trace of one step (graph replays"
    " too); host_launches / host_syncs: CUDA runtime and driver calls inside the step that"
    " launch work / wait for the device (host_calls by name); sync_warnings: warnings of"
    " torch.cuda.set_sync_debug_mode('warn') in another step (misses event waits); ops /"
    " op_syncs: bench/stepops.py's aten ops and host reads of device values in a third"
)


def profile_step(runner: DecodeRunner, is_gpu: bool) -> dict[str, Any]:
    """Kernels, launching calls and waiting calls in a profiler trace of one step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_gpu else [])
    synchronize("cuda" if is_gpu else "cpu")
    with profile(activities=activities) as prof:
        with record_function(STEP_LABEL):
            runner.step()
        synchronize("cuda" if is_gpu else "cpu")
    figures = tally_trace(list(prof.events()))
    return figures if is_gpu else dict.fromkeys(figures)  # a CPU trace has no CUDA calls


def tally_trace(events: list[Any]) -> dict[str, Any]:
    """Kernels, memcpy/memset activities and the launching and waiting host calls inside
    the STEP_LABEL range of a profiler trace (`prof.events()`)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    # NOTE: the label is also a GPU-side annotation event; the host's range is the step
    step = next(e for e in events if e.name == STEP_LABEL and e.device_type == cpu)
    lo, hi = step.time_range.start, step.time_range.end
    kernels = memcpys = 0
    calls: Counter[str] = Counter()
    for e in events:
        if e.device_type == cuda:
            if e.is_user_annotation or e.name == STEP_LABEL:
                continue
            if e.name.startswith(("Memcpy", "Memset")):
                memcpys += 1
            else:
                kernels += 1
        elif lo <= e.time_range.start <= hi and e.name in LAUNCH_CALLS | SYNC_CALLS:
            calls[e.name] += 1
    return {
        "kernels": kernels,
        "memcpy_memset": memcpys,
        "host_launches": sum(n for name, n in calls.items() if name in LAUNCH_CALLS),
        "host_syncs": sum(n for name, n in calls.items() if name in SYNC_CALLS),
        "host_calls": dict(calls),
    }


def sync_warnings(runner: DecodeRunner) -> int:
    """Warnings of torch's sync debug mode in one step."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run_launches(cfg: BenchConfig, model: Model) -> dict[str, Any]:
    """One step of `launch_batch` sequences of `launch_context` tokens, per mode."""
    batch, context, bt = cfg.launch_batch, cfg.launch_context, cfg.block_tokens
    num_steps = cfg.warmup_steps + 3
    cache = random_cache(model, batch * -(-(context + num_steps + 1) // bt), bt)
    rows = []
    for graphs in (False, True) if cfg.is_gpu else (False,):
        runner = DecodeRunner(
            model, cache, max_batch=batch, cuda_graphs=graphs, max_model_len=context + 64
        )
        seat(runner, batch, context, num_steps, seed=1)
        for _ in range(cfg.warmup_steps):
            runner.step()
        row: dict[str, Any] = {"batch": batch, "context": context, "cuda_graphs": graphs}
        row.update(profile_step(runner, cfg.is_gpu))
        row["sync_warnings"] = sync_warnings(runner) if cfg.is_gpu else None
        counter = count(runner.step)
        row.update(
            ops=counter.num_ops, op_syncs=counter.num_syncs, op_sync_sites=dict(counter.syncs)
        )
        assert len(runner.running) == batch, (len(runner.running), batch)
        unseat(runner)
        rows.append(row)
        progress(f"launches graphs={graphs}: {row['kernels']} kernels, {row['host_syncs']} syncs")
        del runner
        release_memory(cfg.device)
    del cache
    release_memory(cfg.device)
    return {"how": HOW, "rows": rows}
