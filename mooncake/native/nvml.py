"""NVIDIA GPUs through NVML (package `nvidia-ml-py`, module `pynvml`, imported lazily).

The NVML access goes through one seam: any object with the pynvml functions used here
(nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetName,
nvmlDeviceGetUUID, nvmlDeviceGetMemoryInfo, nvmlDeviceGetPciInfo) and its `NVMLError`
class. Production passes nothing and gets the real module; tests pass tests/fakes/nvml.py.

GPU indices are NVML's, which enumerates every GPU of the host in PCI bus order; torch's
cuda:N counts only the visible ones (CUDA_VISIBLE_DEVICES): native/cudamap.py maps one to
the other.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import msgspec

from mooncake.native import sysfs

log = logging.getLogger(__name__)


class GpuInfo(msgspec.Struct, frozen=True):
    """One NVIDIA GPU as NVML and sysfs see it."""

    index: int  # NVML index (PCI bus order)
    name: str  # "NVIDIA A100-SXM4-80GB"
    uuid: str  # "GPU-7a8b..."
    memory_total_bytes: int
    memory_free_bytes: int  # free at detection time
    pci_bus_id: str  # "0000:17:00.0" (sysfs form)
    numa_node: int | None  # None = unknown (sysfs -1 or device missing from sysfs)
    pci_path: list[str] = []  # root complex down to the GPU; [] if sysfs lacks the device


def load_pynvml() -> Any | None:
    """The real pynvml module, or None when nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def _text(value: str | bytes) -> str:
    # nvidia-ml-py >= 11.5 returns str; older pynvml returned bytes from char arrays.
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's "00000000:B7:00.0" to sysfs's "0000:b7:00.0"."""
    domain, _, rest = _text(bus_id).strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def _read_gpu(nvml: Any, index: int, sysfs_root: Path) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    bus_id = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    pci = sysfs.read_pci_device(bus_id, sysfs_root)
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total),
        memory_free_bytes=int(memory.free),
        pci_bus_id=bus_id,
        numa_node=pci.numa_node if pci else None,
        pci_path=pci.pci_path if pci else [],
    )


def read_gpus(
    nvml: Any | None = None, sysfs_root: Path = sysfs.DEFAULT_SYSFS_ROOT
) -> tuple[list[GpuInfo], list[str]]:
    """The GPUs NVML reports, and plain-language notes on what could not be read.

    `nvml` is the pynvml seam (None: import the real one). Initialises NVML and shuts it
    down again before returning; a GPU that fails mid-read is left out with a note.
    """
    if nvml is None:
        nvml = load_pynvml()
        if nvml is None:
            return [], ["no NVIDIA GPU found (pynvml not installed: pip install nvidia-ml-py)"]
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return [], [f"no NVIDIA GPU found (NVML could not start: {e})"]
    gpus: list[GpuInfo] = []
    notes: list[str] = []
    try:
        count = nvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                gpus.append(_read_gpu(nvml, index, sysfs_root))
            except nvml.NVMLError as e:
                log.warning("GPU %d skipped: %s", index, e)
                notes.append(f"GPU {index} left out: NVML error: {e}")
        if count == 0:
            notes.append("no NVIDIA GPU found (NVML reports 0 devices)")
    except nvml.NVMLError as e:
        notes.append(f"no NVIDIA GPU found (NVML error: {e})")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.warning("nvmlShutdown failed: %s", e)
    for gpu in gpus:
        if not gpu.pci_path:
            notes.append(f"GPU {gpu.index} ({gpu.pci_bus_id}) is not in sysfs: NUMA node unknown")
    return gpus, notes
