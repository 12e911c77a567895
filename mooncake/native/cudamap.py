"""torch's `cuda:N` to the physical GPU NVML reports, honouring CUDA_VISIBLE_DEVICES.

NVML numbers every GPU of the host in PCI bus order; CUDA (so torch) numbers only the
visible ones, in the order CUDA_VISIBLE_DEVICES lists them. Its entries are indices into
CUDA's own enumeration (PCI bus order with CUDA_DEVICE_ORDER=PCI_BUS_ID; the default,
FASTEST_FIRST, orders by speed and then bus id, which is bus order when the GPUs are all
the same model), full or prefix GPU UUIDs ("GPU-8a3b..."), or MIG UUIDs; as CUDA does,
the list ends at the first entry that names no device, and an empty variable hides
every GPU. When torch has initialised CUDA its UUIDs decide instead (`torch_uuids`).

The topology's NIC preference and memory figures are keyed by NVML index; whatever uses a
torch device (the KV cache, a tensor's segment location) goes through `visible_gpus`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake.native.nvml import GpuInfo

log = logging.getLogger(__name__)


def _parse_entry(entry: str, gpus: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU one CUDA_VISIBLE_DEVICES entry names (NVML order = CUDA's here), or None."""
    entry = entry.strip()
    if entry.isdigit():
        index = int(entry)
        return gpus[index] if index < len(gpus) else None
    if entry.startswith("MIG-"):
        return None  # NOTE: a MIG instance's parent is not in NVML's device UUIDs
    want = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    found = [g for g in gpus if g.uuid.lower().startswith(want.lower())]
    return found[0] if len(found) == 1 else None  # an ambiguous prefix names no device


def visible_gpus(
    gpus: Sequence[GpuInfo],
    env: Mapping[str, str] | None = None,
    torch_uuids: Sequence[str] | None = None,
) -> list[GpuInfo]:
    """The GPUs torch sees, in torch's order: element i is `cuda:i` (NVML's GpuInfo).

    `env`: the process environment (default os.environ); `torch_uuids`: the UUIDs torch
    reports per device index ("7a8b..." or "GPU-7a8b..."), which decide when given."""
    ordered = sorted(gpus, key=lambda g: g.index)
    if torch_uuids is not None:
        by_uuid = {g.uuid.lower().removeprefix("gpu-"): g for g in ordered}
        return [
            by_uuid[u.lower().removeprefix("gpu-")]
            for u in torch_uuids
            if u.lower().removeprefix("gpu-") in by_uuid
        ]
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return ordered
    seen: list[GpuInfo] = []
    for entry in value.split(","):
        gpu = _parse_entry(entry, ordered) if entry.strip() else None
        if gpu is None or gpu in seen:
            break  # NOTE: as CUDA: devices listed after an invalid entry are not visible
        seen.append(gpu)
    return seen


def torch_uuids() -> list[str] | None:
    """The UUID of every device torch sees, if torch has CUDA; None otherwise."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [str(getattr(p, "uuid", "")) for p in props]


def torch_memory_bytes(index: int = 0) -> int | None:
    """Total memory of torch's `cuda:index` as CUDA reports it, if torch has CUDA (the
    figure for a GPU that NVML does not report); None otherwise."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(index).total_memory)


def torch_keyed(matrix: Mapping[str, Any], visible: Sequence[GpuInfo]) -> dict[str, Any]:
    """`matrix` (keyed "cpu:N" and NVML's "cuda:N") keyed by torch's device index instead:
    "cuda:i" is the entry of visible[i]; hidden GPUs are left out."""
    keyed = {k: v for k, v in matrix.items() if not k.startswith("cuda:")}
    for i, gpu in enumerate(visible):
        if f"cuda:{gpu.index}" in matrix:
            keyed[f"cuda:{i}"] = matrix[f"cuda:{gpu.index}"]
    return keyed


def gpu_of(device: str, visible: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU behind torch device `device` ("cuda", "cuda:1"), or None (cpu, unknown)."""
    if not device.startswith("cuda"):
        return None
    index = int(device.partition(":")[2] or 0)
    return visible[index] if index < len(visible) else None
