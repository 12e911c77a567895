"""The Conductor's cost model of a local cluster: profiled once on this machine for the
model and its block and chunk sizes, and cached by that shape in a private directory."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from mooncake.roles.local import DECODE_KV_BYTES, LocalPlan
from mooncake.roles.runfile import private_dir, write_private


def ensure_cost_model(
    plan: LocalPlan, cache_dir: Path, on_progress: Callable[[str], None] = lambda _: None
) -> Path:
    """The Conductor's cost model for the plan's model on this machine: profiled once
    (a few seconds for dummy:tiny, one thread as the nodes run) and cached by shape."""
    if plan.cost_model_path:
        return Path(plan.cost_model_path)
    import torch

    from mooncake.engine.kvobject import DTYPE_BYTES
    from mooncake.engine.modelinfo import load_model_info, resolve_dtype
    from mooncake.engine.profiling import profile_cost_model

    name = plan.model.replace(":", "-").replace("/", "_")
    # NOTE: "p2": prompts up to 4096 tokens sampled (1024 before: a quadratic fitted there
    # overestimated a 5,000-token prefill by 60%); a cached file of the old grid is not reused
    tag = f"{name}-b{plan.block_tokens}-c{plan.chunk_tokens}-p2"
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
            1,
            capacity,
            2e9,
            on_progress,
        )
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:  # save() follows symlinks; write_private not
        model.save(Path(tmp) / path.name)
        return write_private(cache_dir, path.name, (Path(tmp) / path.name).read_bytes())
