"""The Conductor's cost model of a local cluster: profiled once on this machine for the
model and its block and chunk sizes, scaled by the co-run slowdown of its nodes on this host
(`model/corun.py`), and cached by that shape in a private directory."""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

from mooncake.local.config import DECODE_KV_BYTES
from mooncake.local.plan import LocalPlan
from mooncake.local.runfile import private_dir, write_private
from mooncake.model.spec import ModelSpec


def ensure_cost_model(
    plan: LocalPlan, cache_dir: Path, on_progress: Callable[[str], None] = lambda _: None
) -> Path:
    """The Conductor's cost model for the plan's model on this machine: profiled once
    (a few seconds for dummy:tiny, one thread as the nodes run, medians of 3 runs), scaled
    by the slowdown of the plan's nodes computing at once on this host, cached by shape."""
    if plan.cost_model_path:
        return Path(plan.cost_model_path)
    import torch

    from mooncake.kv.object import DTYPE_BYTES
    from mooncake.model.corun import measure_corun, scale_cost_model
    from mooncake.model.info import load_model_info, resolve_dtype
    from mooncake.model.profiling import profile_cost_model

    name = plan.model.replace(":", "-").replace("/", "_")
    # the nodes that compute at once on this host, a core each (model/corun.py)
    busy = min(plan.num_prefill + plan.num_decode, len(os.sched_getaffinity(0)))
    # NOTE: "p2": prompts up to 4096 tokens sampled (1024 before: a quadratic fitted there
    # overestimated a 5,000-token prefill by 60%); "k": scaled by the co-run slowdown of
    # that many nodes; "m3a": medians of 3 runs, fewer for a prefill past 2 s (profiling.py),
    # the co-run prefill sized by the model's work (corun_tokens). A cached file of an older
    # kind is not reused, nor one of another CPU, torch or matmul backend (a profile prices
    # this host only)
    tag = f"{name}-b{plan.block_tokens}-c{plan.chunk_tokens}-p2-k{busy}-m3a-{host_tag(plan)}"
    path = private_dir(cache_dir) / f"costmodel-{tag}.json"
    if path.exists():
        return path
    on_progress(f"profiling {plan.model} once for the Conductor's cost model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        info = load_model_info(plan.model)
        dtype = resolve_dtype(info, "auto", "cpu")
        capacity = DECODE_KV_BYTES // info.spec.kv_bytes_per_token(DTYPE_BYTES[dtype])
        model, _, _ = profile_cost_model(
            info,
            dtype,
            plan.block_tokens,
            plan.chunk_tokens,
            [64, 256, 512, 1024, 2048, 4096],
            [0.0, 0.5],
            [1, 4, 16],
            [64, 256],
            4,
            3,
            capacity,
            2e9,
            on_progress,
            plan.cpu_gemm,
        )
        bt, chunk, gemm = plan.block_tokens, plan.chunk_tokens, plan.cpu_gemm
        tokens = corun_tokens(info.spec)
        corun = measure_corun(
            info, dtype, bt, chunk, busy, tokens, progress=on_progress, cpu_gemm=gemm
        )
        model = scale_cost_model(model, corun)
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:  # save() follows symlinks; write_private not
        model.save(Path(tmp) / path.name)
        return write_private(cache_dir, path.name, (Path(tmp) / path.name).read_bytes())


CORUN_FLOPS = 32e9  # a co-run prefill's work: dummy:tiny's 1,024 tokens, ~1 s on one core


def corun_tokens(spec: ModelSpec) -> int:
    """The co-run measurement's prompt: 1,024 tokens, halved down to 256 while its prefill
    takes more than CORUN_FLOPS (the slowdown is a ratio; a real model's 1,024-token
    prefill on one core takes seconds, timed ten times)."""
    tokens = 1024
    while tokens > 256 and spec.prefill_flops(tokens) > CORUN_FLOPS:
        tokens //= 2
    return tokens


def host_tag(plan: LocalPlan) -> str:
    """What a profile depends on besides the model's shape, hashed: the CPU model, the
    torch version and the matmul backend (`model.cpu_gemm`)."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    digest = hashlib.sha256(f"{cpu}|{torch.__version__}".encode()).hexdigest()[:10]
    return f"{plan.cpu_gemm}-{digest}"
