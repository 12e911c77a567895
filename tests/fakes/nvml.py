"""A fake `pynvml` for machines without NVIDIA GPUs, with the real module's semantics.

What it emulates (nvidia-ml-py):
- `NVMLError(value)` builds the subclass of that error code (NVMLError_Uninitialized, ...),
  whose str() is NVML's error string; `value` is the code.
- nvmlInit/nvmlShutdown are reference counted; every other call before nvmlInit (or after
  the last nvmlShutdown) raises NVMLError_Uninitialized, as does an unbalanced nvmlShutdown.
- Devices are enumerated in PCI bus order; a bad index raises NVMLError_InvalidArgument.
- Names and UUIDs are str (nvidia-ml-py >= 11.5) or bytes (`legacy_bytes=True`, old pynvml);
  the PCI info's busId is "%08X:%02X:%02X.0" ("00000000:B7:00.0").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    """Base of NVML errors; NVMLError(code) is an instance of that code's subclass."""

    _value_to_class: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int) -> NVMLError:
        cls = NVMLError._value_to_class.get(value, cls) if cls is NVMLError else cls
        return Exception.__new__(cls)

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, value: int) -> type[NVMLError]:
    error_class = type(f"NVMLError_{name}", (NVMLError,), {})
    NVMLError._value_to_class[value] = error_class
    return error_class


NVMLError_Uninitialized = _error_class("Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_DriverNotLoaded = _error_class("DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("GpuIsLost", NVML_ERROR_GPU_IS_LOST)


@dataclass(frozen=True)
class _Memory:  # c_nvmlMemory_t
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _PciInfo:  # nvmlPciInfo_t (the fields read by callers)
    busId: str | bytes  # noqa: N815 - NVML's field name
    busIdLegacy: str | bytes  # noqa: N815
    domain: int
    bus: int
    device: int


@dataclass(frozen=True)
class _Handle:  # c_nvmlDevice_t: opaque to callers
    index: int


class FakeNvml:
    """The pynvml functions mooncake calls, over GPUs described as in the fixtures.

    `gpus`: dicts with pci ("0000:07:00.0"), name, uuid, memory_total_bytes and
    memory_free_bytes. `init_error`: an NVML error code nvmlInit raises (driver missing).
    `lost`: indices whose memory query fails with GPU_IS_LOST.
    """

    NVMLError = NVMLError

    def __init__(
        self,
        gpus: list[dict[str, Any]],
        *,
        legacy_bytes: bool = False,
        init_error: int | None = None,
        lost: frozenset[int] = frozenset(),
    ):
        self._gpus = sorted(gpus, key=lambda g: g["pci"])  # NVML enumerates in PCI bus order
        self._legacy_bytes = legacy_bytes
        self._init_error = init_error
        self._lost = lost
        self.init_count = 0  # > 0 while initialised
        self.calls: list[str] = []

    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self._legacy_bytes else text

    def _gpu(self, handle: _Handle) -> dict[str, Any]:
        if not isinstance(handle, _Handle) or not 0 <= handle.index < len(self._gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._gpus[handle.index]

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls.append("nvmlInit")
        if self._init_error is not None:
            raise NVMLError(self._init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._check("nvmlShutdown")
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:  # noqa: N802
        self._check("nvmlDeviceGetName")
        return self._str(self._gpu(handle)["name"])

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str | bytes:  # noqa: N802
        self._check("nvmlDeviceGetUUID")
        return self._str(self._gpu(handle)["uuid"])

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _Memory:  # noqa: N802
        self._check("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        if handle.index in self._lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        total, free = gpu["memory_total_bytes"], gpu["memory_free_bytes"]
        return _Memory(total=total, free=free, used=total - free)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> _PciInfo:  # noqa: N802
        self._check("nvmlDeviceGetPciInfo")
        domain_text, bus_text, rest = self._gpu(handle)["pci"].split(":")
        domain, bus, device = int(domain_text, 16), int(bus_text, 16), int(rest.split(".")[0], 16)
        return _PciInfo(
            busId=self._str(f"{domain:08X}:{bus:02X}:{device:02X}.0"),
            busIdLegacy=self._str(f"{domain:04X}:{bus:02X}:{device:02X}.0"),
            domain=domain,
            bus=bus,
            device=device,
        )
