"""Raw addresses as upstream's Python API passes them: the memory at an address, wrapped
without a copy, host or CUDA.

Host memory becomes a numpy uint8 array over the address (ctypes), after /proc/self/maps
confirms the range is mapped and writable, so a bad address is refused at registration
instead of crashing the process at the first transfer. Device memory is recognised through
the CUDA driver's pointer attributes (libcuda, through ctypes, only where it loads) and
becomes a torch uint8 tensor over the address (`__cuda_array_interface__`, no copy), which
the Transfer Engine moves as any CUDA tensor (staged over tcp, registered for rdma).
NOTE: the CUDA branch needs libcuda and a CUDA build of torch; it has not run on the
machines this was written on (CPU only).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_ATTR_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_ATTR_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


@functools.cache
def _libcuda() -> Any:
    """The CUDA driver, initialised, or None where there is none (CPU hosts)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if lib.cuInit(0) != 0:
        log.info("libcuda loaded but cuInit failed: treating every address as host memory")
        return None
    return lib


@functools.cache
def cuda_supported() -> bool:
    """Whether device pointers can be registered and moved here: the CUDA driver answers,
    it sees a device, and torch (which moves device memory) is installed."""
    lib = _libcuda()
    if lib is None or importlib.util.find_spec("torch") is None:
        return False
    count = ctypes.c_int(0)
    return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def cuda_device_of(address: int) -> int | None:
    """The ordinal of the CUDA device whose memory `address` is, or None (host memory,
    pinned host memory included, or no CUDA here)."""
    lib = _libcuda()
    if lib is None:
        return None
    kind = ctypes.c_uint(0)
    ptr = ctypes.c_uint64(address)
    if lib.cuPointerGetAttribute(ctypes.byref(kind), _ATTR_MEMORY_TYPE, ptr) != 0:
        return None  # NOTE: CUDA_ERROR_INVALID_VALUE: memory CUDA does not know (malloc'd)
    if kind.value != _MEMORYTYPE_DEVICE:
        return None
    ordinal = ctypes.c_int(-1)
    if lib.cuPointerGetAttribute(ctypes.byref(ordinal), _ATTR_DEVICE_ORDINAL, ptr) != 0:
        return None
    return ordinal.value


def _mapped_writable(address: int, num_bytes: int) -> bool:
    """Whether [address, address + num_bytes) lies in writable mappings of this process
    (adjacent mappings together); True where /proc/self/maps cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return True
    want, end = address, address + num_bytes
    for line in lines:  # NOTE: the kernel lists mappings in address order
        fields = line.split(maxsplit=2)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if hi <= want or lo > want:
            continue
        if "w" not in fields[1]:
            return False
        want = hi
        if want >= end:
            return True
    return False


class _CudaSpan:
    """Raw device memory seen through `__cuda_array_interface__` (what torch.as_tensor reads)."""

    def __init__(self, address: int, num_bytes: int):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


def memory_at(address: int, num_bytes: int) -> tuple[Any, str]:
    """The `num_bytes` at `address` as a buffer the Transfer Engine registers (no copy) and
    its location ("cpu:0" or "cuda:N"). Raises ValueError for an address that is no
    memory of this process (unmapped, read-only) or a size <= 0."""
    if address <= 0 or num_bytes <= 0:
        raise ValueError(f"need an address and a size > 0, got {address:#x} and {num_bytes}")
    device = cuda_device_of(address)
    if device is not None:
        import torch  # NOTE: only where the address is device memory

        span = _CudaSpan(address, num_bytes)
        return torch.as_tensor(span, device=f"cuda:{device}"), f"cuda:{device}"
    if os.name == "posix" and not _mapped_writable(address, num_bytes):
        raise ValueError(
            f"[{address:#x}, {address + num_bytes:#x}) is not writable memory of this process"
        )
    array = np.frombuffer(
        memoryview((ctypes.c_ubyte * num_bytes).from_address(address)).cast("B"), dtype=np.uint8
    )
    return array, "cpu:0"
