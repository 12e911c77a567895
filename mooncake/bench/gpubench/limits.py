"""The physical limits every gpubench figure is set beside: the GPU's HBM bandwidth and
dense bf16 peak, by name from the vendors' datasheets, and a device-to-device copy
measured here (the practical ceiling of a memory-bound kernel, and the bandwidth used for
a GPU the table does not know)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncake.model.attention.timing import copy_gbps

# (fragment of torch.cuda.get_device_name(), HBM GB/s, dense bf16 TFLOP/s), the first
# fragment found wins, so the more specific come first. Vendor datasheets.
KNOWN_GPUS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4800.0, 989.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100", 3350.0, 989.0),  # SXM, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB", 1935.0, 312.0),  # PCIe
    ("A100", 1555.0, 312.0),  # 40 GB, SXM4 and PCIe
    ("L40S", 864.0, 362.0),
)


@dataclass(frozen=True)
class Limits:
    """What the device can do at most."""

    device_name: str
    hbm_GBps: float  # memory bandwidth the figures are shares of
    hbm_source: str  # "datasheet" or "measured copy" (a GPU not in KNOWN_GPUS, the CPU)
    copy_GBps: float  # a device-to-device copy measured now, bytes read + written
    bf16_TFLOPs: float | None  # dense bf16 peak (MFU's denominator); None when unknown


def measure_limits(device: str, copy_bytes: int) -> Limits:
    """The limits of `device` ("cuda" or "cpu"), with its copy bandwidth measured now."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    copy = copy_gbps(copy_bytes, device)
    for fragment, hbm, tflops in KNOWN_GPUS:
        if device == "cuda" and fragment in name:
            return Limits(name, hbm, "datasheet", copy, tflops)
    return Limits(name, copy, "measured copy", copy, None)
