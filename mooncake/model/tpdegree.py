"""How many ranks an instance's model is split over (`model.tensor_parallel`), torch-free
so that a node's parent can divide its GPUs among instances by it (pure: GPU counts and
memory come in as arguments).

A degree must divide the model (`shard_problem`: query heads, KV heads or the reverse,
the MLP's and the experts' widths). Automatic (0): 1 on a CPU node; on GPUs the smallest
power of two, at most the GPUs visible, at which each GPU's share of the weights
(weights / degree) fits in WEIGHT_SHARE of one GPU's memory, so the rest holds the KV
cache, activations and CUDA's own memory. The share counts every weight split evenly;
the replicated norms (and KV heads, when fewer than ranks) are a small error below the
margin. An 8B model in bf16 (16 GB) on 80 GB GPUs: 1; a 70B one (141 GB): 4 (35 GB each
against 48 GB); Mixtral 8x7B (93 GB): 2.
"""

from __future__ import annotations

from mooncake.errors import ConfigError
from mooncake.model.spec import ModelSpec

KEY = "model.tensor_parallel"
# NOTE: weights take at most this share of each GPU's memory at the automatic degree;
# the rest is the KV cache's (a degree that leaves it under ~40% serves short batches)
WEIGHT_SHARE = 0.6
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shard_problem(spec: ModelSpec, size: int) -> str:
    """What of `spec` `size` ranks do not divide ("its 4 attention heads"), or ""."""
    if spec.num_heads % size:
        return f"its {spec.num_heads} attention heads"
    if spec.num_kv_heads % size and size % spec.num_kv_heads:
        return f"its {spec.num_kv_heads} KV heads (nor does it divide them)"
    if spec.num_moe_layers < spec.num_layers and spec.intermediate_size % size:
        return f"its MLP width {spec.intermediate_size}"
    if spec.num_experts and spec.moe_intermediate_size % size:
        return f"its experts' width {spec.moe_intermediate_size}"
    return ""


def auto_degree(spec: ModelSpec, weight_bytes: int, num_gpus: int, gpu_bytes: int) -> int:
    """The smallest power of two n <= `num_gpus` that divides `spec` and with
    `weight_bytes` / n <= WEIGHT_SHARE * `gpu_bytes` (one GPU's memory). Raises
    ConfigError when none does."""
    n = 1
    while n <= num_gpus:
        if not shard_problem(spec, n) and weight_bytes / n <= WEIGHT_SHARE * gpu_bytes:
            return n
        n *= 2
    splits = [d for d in range(1, num_gpus + 1) if not shard_problem(spec, d)]
    raise ConfigError(
        f"{KEY} = 0 (automatic): {spec.name}'s weights ({weight_bytes / 2**30:.1f} GiB) fit "
        f"in {WEIGHT_SHARE:.0%} of a GPU's {gpu_bytes / 2**30:.1f} GiB at no power-of-two "
        f"degree up to the {num_gpus} visible GPUs that divides the model; give more or "
        f"larger GPUs, a smaller dtype or model, or set {KEY} to one of "
        f"{', '.join(map(str, splits))} explicitly"
    )


def resolve_degree(setting: int, spec: ModelSpec, dtype: str, gpu_bytes: list[int]) -> int:
    """The degree of `model.tensor_parallel` = `setting` for a model of `spec` computed
    in `dtype`, over GPUs of `gpu_bytes` memory each ([] on a CPU node: automatic is 1).
    Raises ConfigError for more ranks than GPUs, a degree that does not divide the model,
    or an automatic one that finds none."""
    if setting == 0:
        if not gpu_bytes:
            return 1
        weight_bytes = spec.weight_bytes(DTYPE_BYTES[dtype])
        return auto_degree(spec, weight_bytes, len(gpu_bytes), min(gpu_bytes))
    if gpu_bytes and setting > len(gpu_bytes):
        raise ConfigError(f"{KEY} = {setting} needs {setting} GPUs; {len(gpu_bytes)} are visible")
    if why := shard_problem(spec, setting):
        raise ConfigError(f"{KEY} = {setting} does not divide {why}")
    return setting
