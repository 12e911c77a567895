"""Analytic roofline cost model for a named GPU and model under tensor parallelism.

Used when no `mooncake profile` file exists, and by the simulator to run the paper's setup
(LLaMA2-70B on nodes of 8x A800, tensor parallel 8). All times in seconds.

Prefill is compute-bound (N = tensor-parallel GPUs, F = peak bf16 FLOP/s, new = L - r):

    T_prefill(L, r) = OVERHEAD + new * (2 * params_matmul / (N * F * MFU) + allreduce_per_token)
                      + attn_pair_flops * (L^2 - r^2) / 2 / (N * F * MFU)

(`attn_pair_flops` = 4 * layers * heads * head_dim: QK^T and PV per query/key pair; the causal
mask halves the square.) Decode is memory-bound: each step reads every weight and every
token's KV once, plus a small compute term per sequence and the all-reduce latencies:

    T_step(b, C) = OVERHEAD + 2 * layers * ALLREDUCE_LATENCY + b * 2 * params_matmul / (N * F * MFU)
                   + (weight_bytes + kv_bytes_per_token * C) / (N * HBM * MBU)

Both are polynomials, so the roofline writes the same file format as a profile fit.

GPU constants (dense bf16 tensor FLOP/s, HBM bytes/s, HBM bytes, NVLink bytes/s
bidirectional per GPU) are NVIDIA datasheet figures: A100/A800 80GB SXM: 312 TFLOPS,
2,039 GB/s; A800's NVLink is limited to 400 GB/s (A800 product brief; A100: 600 GB/s).
H100 SXM: 989 TFLOPS, 3.35 TB/s, NVLink 900 GB/s (H100 datasheet); H800 SXM: the same chip
with NVLink limited to 400 GB/s. Node NIC: the paper's A800 testbed has RDMA "up to
800 Gbps" per node (100 GB/s); H100/H800 nodes commonly carry 8x 400 Gbps (400 GB/s).

Efficiencies are assumptions, stated here so they can be changed in one place:
MFU 0.5 (long-context prefill with FlashAttention reaches 50-60% of peak on A100-class
GPUs), MBU 0.6 (decode kernels reach 50-70% of HBM bandwidth), 10 us per NCCL all-reduce
on NVLink (small-message latency), 5 ms fixed per forward pass (launch, sampling,
scheduling), and 90% of VRAM for weights + KV (vLLM's default `gpu_memory_utilization`).

At master start (`master_cost_model`, which `mooncake config check` calls too) the cost
model is the profile file at `scheduler.cost_model_path` when set; else the roofline of
the model's own shape (any spec `model.path` loads: built-in names and HF directories) on
the GPUs this host detects when they are one of the types above (tensor parallel = their
count), else on H800 x8, the paper-era default, which a log line then states. Where the
weights do not fit, tensor parallelism doubles until they do (a multi-node instance).
Without a profile, the master then follows its prefill nodes (`PrefillHardware`): the
first to register with GPUs of a known type sets the roofline to theirs (a master on a
machine without GPUs schedules for the GPUs that prefill); with none anywhere (CPU nodes)
the figures stay, and a log line says which hardware they assume.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from mooncake.conductor.costmodel import (
    COST_MODEL_VERSION,
    CostModel,
    CostModelError,
    CostModelFile,
    Poly2,
    Term,
)
from mooncake.errors import ConfigError
from mooncake.model.spec import ModelSpec, get_model_spec

if TYPE_CHECKING:
    from mooncake.config.settings import Config
    from mooncake.model.info import ModelInfo

log = logging.getLogger(__name__)

PREFILL_MFU = 0.5
DECODE_MBU = 0.6
ALLREDUCE_LATENCY_S = 10e-6
STEP_OVERHEAD_S = 0.005
VRAM_UTILIZATION = 0.9
DEFAULT_GPU = "H800"  # assumed when this host has no GPU of a known type
DEFAULT_TP = 8  # GPUs per instance assumed with DEFAULT_GPU
MAX_TP = 1024  # tensor parallelism the roofline stops doubling at


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    bf16_flops: float  # dense FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float  # VRAM capacity
    nvlink_bytes_per_s: float  # bidirectional, per GPU
    node_nic_bytes_per_s: float  # RDMA bandwidth of an 8-GPU node


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            name="A800",
            bf16_flops=312e12,
            hbm_bytes_per_s=2.039e12,
            hbm_bytes=80e9,
            nvlink_bytes_per_s=400e9,
            node_nic_bytes_per_s=100e9,
        ),
        GpuSpec(
            name="A100",
            bf16_flops=312e12,
            hbm_bytes_per_s=2.039e12,
            hbm_bytes=80e9,
            nvlink_bytes_per_s=600e9,
            node_nic_bytes_per_s=100e9,
        ),
        GpuSpec(
            name="H800",
            bf16_flops=989e12,
            hbm_bytes_per_s=3.35e12,
            hbm_bytes=80e9,
            nvlink_bytes_per_s=400e9,
            node_nic_bytes_per_s=400e9,
        ),
        GpuSpec(
            name="H100",
            bf16_flops=989e12,
            hbm_bytes_per_s=3.35e12,
            hbm_bytes=80e9,
            nvlink_bytes_per_s=900e9,
            node_nic_bytes_per_s=400e9,
        ),
    )
}


def get_gpu(name: str) -> GpuSpec:
    key = name.strip().upper()
    if key not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def roofline_cost_model(
    model: ModelSpec | str, gpu: GpuSpec | str, tp: int = 8, dtype_bytes: int = 2
) -> CostModel:
    """The roofline cost model of `model` on `tp` GPUs of type `gpu` (see module doc)."""
    spec = get_model_spec(model) if isinstance(model, str) else model
    dev = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if tp < 1:
        raise ConfigError(f"tensor parallel size must be >= 1, got {tp}")
    flops = tp * dev.bf16_flops * PREFILL_MFU  # FLOP/s the instance sustains
    hbm = tp * dev.hbm_bytes_per_s * DECODE_MBU  # bytes/s the instance sustains
    # Ring all-reduce of the hidden state, twice per layer: each GPU sends 2(N-1)/N of it
    # over NVLink (half the bidirectional figure in each direction).
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    allreduce_s_per_token = (
        2 * spec.num_layers * ring * spec.hidden_size * dtype_bytes / (dev.nvlink_bytes_per_s / 2)
    )
    linear = spec.flops_per_token / flops + allreduce_s_per_token  # s per new token
    quad = spec.attn_flops_per_token_pair / 2 / flops  # s per (L^2 - r^2)
    prefill = Poly2(
        variables=("input_len", "reused_len"),
        terms=(
            Term((0, 0), STEP_OVERHEAD_S),
            Term((1, 0), linear),
            Term((0, 1), -linear),
            Term((2, 0), quad),
            Term((0, 2), -quad),
        ),
    )
    weight_bytes = spec.weight_bytes(dtype_bytes)
    fixed = STEP_OVERHEAD_S + (2 * spec.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0)
    decode = Poly2(
        variables=("batch_size", "context_len"),
        terms=(
            Term((0, 0), fixed + weight_bytes / hbm),
            Term((1, 0), spec.flops_per_token / flops),
            Term((0, 1), spec.kv_bytes_per_token(dtype_bytes) / hbm),
        ),
    )
    kv_room = tp * dev.hbm_bytes * VRAM_UTILIZATION - weight_bytes
    if kv_room <= 0:
        raise ConfigError(
            f"{spec.name} does not fit in {tp}x {dev.name} (VRAM {dev.hbm_bytes:.0f} B)"
        )
    return CostModel(
        CostModelFile(
            version=COST_MODEL_VERSION,
            model=spec.name,
            device=f"{dev.name} x{tp} (tp={tp})",
            source="roofline",
            kv_bytes_per_token=spec.kv_bytes_per_token(dtype_bytes),
            kv_capacity_tokens=int(kv_room // spec.kv_bytes_per_token(dtype_bytes)),
            link_bytes_per_s=dev.node_nic_bytes_per_s,
            prefill=prefill,
            decode=decode,
        )
    )


def match_gpu(device_name: str) -> GpuSpec | None:
    """The known GPU type a detected device name (NVML's "NVIDIA H100 80GB HBM3") is."""
    upper = device_name.upper()
    return next((g for key, g in GPUS.items() if key in upper), None)


def fitting_roofline(
    spec: ModelSpec, gpu: GpuSpec, tp: int, dtype_bytes: int
) -> tuple[CostModel, int]:
    """The roofline on `tp` GPUs, or on the fewest doublings of `tp` the weights fit in."""
    while True:
        try:
            return roofline_cost_model(spec, gpu, tp, dtype_bytes), tp
        except ConfigError:
            if tp * 2 > MAX_TP:
                raise
            tp *= 2


def hardware_roofline(
    spec: ModelSpec, gpu_names: Sequence[str], dtype_bytes: int = 2, where: str = "this host"
) -> tuple[CostModel, str]:
    """The roofline of `spec` on the `gpu_names` detected on `where`, or on DEFAULT_TP x
    DEFAULT_GPU when none is of a known type; with a sentence saying which and why."""
    known = [g for g in map(match_gpu, gpu_names) if g is not None]
    if known:
        gpu, tp, why = known[0], len(known), f"detected on {where}"
    else:
        gpu, tp = GPUS[DEFAULT_GPU], DEFAULT_TP
        seen = ", ".join(sorted(set(gpu_names))) or "no GPU"
        why = f"the default ({seen} detected here; known types: {', '.join(sorted(GPUS))})"
    cost, used_tp = fitting_roofline(spec, gpu, tp, dtype_bytes)
    if used_tp != tp:
        why += f"; {tp} GPUs cannot hold the weights, so {used_tp} are assumed"
    return cost, f"{gpu.name} x{used_tp}, {why}"


def master_cost_model(
    cfg: Config, info: ModelInfo, gpu_names: Sequence[str] | None = None
) -> tuple[CostModel, str]:
    """The cost model the master schedules with (see the module doc), and a sentence
    saying where it came from. `gpu_names` None: read them through NVML.

    Raises ConfigError naming scheduler.cost_model_path when that file is missing, does
    not parse, or was made for another model. Shared by the master and `config check`.
    """
    path = cfg.scheduler.cost_model_path
    if path:
        try:
            cost = CostModel.load(path)
        except CostModelError as e:
            raise ConfigError(f"scheduler.cost_model_path: {e}") from e
        if cost.spec.model != info.spec.name:  # NOTE: another model's costs mislead quietly
            raise ConfigError(
                f"scheduler.cost_model_path: {path} is a cost model of {cost.spec.model!r}, "
                f"but model.path serves {info.spec.name!r}; make one for this model with "
                "`mooncake profile` (on a prefill node, with this config), or set "
                'scheduler.cost_model_path = "" for the roofline of its shape'
            )
        return cost, f"profile {path} ({cost.spec.device})"
    if gpu_names is None:
        from mooncake.native.nvml import read_gpus

        gpu_names = [g.name for g in read_gpus()[0]]
    cost, why = hardware_roofline(info.spec, gpu_names, gpu_dtype_bytes(cfg, info))
    return cost, f"roofline of {info.spec.name} on {why}"


def gpu_dtype_bytes(cfg: Config, info: ModelInfo) -> int:
    """Bytes per weight and KV element of the engines' dtype on a GPU."""
    from mooncake.model.info import resolve_dtype

    return 4 if resolve_dtype(info, cfg.model.dtype, "cuda") == "float32" else 2


class CostModelUser(Protocol):
    """What `PrefillHardware` changes: the Conductor, as whatever schedules by a cost model."""

    def use_cost_model(self, cost: CostModel) -> None: ...


class PrefillHardware:
    """Keeps the master's roofline on the hardware its prefill nodes report when they
    register (`NodeInfoMsg.gpus`), unless a profile file is configured: the first one with
    GPUs of a known type sets the roofline (that type, tensor parallel = their count), and
    a log line says so; nodes without one leave the figures as they are, said once."""

    def __init__(self, cfg: Config, info: ModelInfo, cost: CostModel):
        self.spec, self.dtype_bytes = info.spec, gpu_dtype_bytes(cfg, info)
        self.device = cost.spec.device  # what the figures in use assume
        self.is_settled = bool(cfg.scheduler.cost_model_path)  # a profile is never replaced
        self.is_cpu_said = False

    def follow(self, node_id: str, gpus: Sequence[str], conductor: CostModelUser) -> None:
        """A prefill node registered with `gpus`: schedule on its roofline if it is the
        first with GPUs of a known type (call with the Conductor's lock held)."""
        if self.is_settled:
            return
        if not any(match_gpu(g) for g in gpus):
            if not self.is_cpu_said:
                self.is_cpu_said = True
                known = ", ".join(sorted(GPUS))
                what = f"GPUs {', '.join(gpus)} (known types: {known})" if gpus else "no GPU"
                log.info(
                    "prefill node %s reports %s: the cost model's roofline still assumes %s; "
                    "set scheduler.cost_model_path to a `mooncake profile` file made on a "
                    "prefill node for measured figures",
                    node_id,
                    what,
                    self.device,
                )
            return
        self.is_settled = True
        cost, why = hardware_roofline(self.spec, gpus, self.dtype_bytes, f"prefill node {node_id}")
        if cost.spec.device == self.device:
            return
        log.info(
            "cost model: roofline of %s on %s (instead of %s)", self.spec.name, why, self.device
        )
        self.device = cost.spec.device
        conductor.use_cost_model(cost)
