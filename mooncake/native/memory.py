"""Raw views of buffers: a writable byte memoryview and the address of numpy arrays, torch
tensors, bytearrays, mmaps and shared-memory arenas; alignment helpers.

The Transfer Engine moves bytes between registered buffers without copying them into Python
objects, so every buffer is reduced to a `BufferView`: a flat writable `memoryview` of its
bytes (None for device memory such as CUDA tensors), its start address and its length.
torch stays optional: it is recognised by duck typing and never imported here.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE_BYTES = mmap.PAGESIZE
CACHELINE_BYTES = 64


@dataclass(frozen=True)
class BufferView:
    """The bytes of a buffer, as the transports use them."""

    mv: memoryview | None  # flat, writable, format "B"; None for device (CUDA) memory
    address: int  # virtual address of the first byte (device address for CUDA)
    num_bytes: int  # length
    location: str  # "cpu:N" or "cuda:N"
    owner: Any  # the object whose memory this is; kept alive while the view lives


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of `alignment` (a power of two) that is >= value."""
    assert alignment > 0 and alignment & (alignment - 1) == 0, alignment
    return (value + alignment - 1) & ~(alignment - 1)


def is_aligned(value: int, alignment: int) -> bool:
    """True when `value` is a multiple of `alignment`."""
    return value % alignment == 0


def aligned_empty(num_bytes: int, alignment: int = PAGE_BYTES) -> np.ndarray:
    """An uninitialised uint8 array of `num_bytes` whose first byte is `alignment`-aligned."""
    raw = np.empty(num_bytes + alignment, dtype=np.uint8)
    start = align_up(raw.ctypes.data, alignment) - raw.ctypes.data
    return raw[start : start + num_bytes]


def address_of(mv: memoryview) -> int:
    """Address of the first byte of a writable, C-contiguous memoryview."""
    if mv.readonly:
        raise ValueError("need a writable buffer to take its address")
    if mv.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def _is_torch_tensor(obj: Any) -> bool:
    # NOTE: a type made at run time (a ctypes array type) may have __module__ None
    module = getattr(type(obj), "__module__", None) or ""
    return module.startswith("torch") and hasattr(obj, "data_ptr")


def _torch_view(tensor: Any, location: str | None) -> BufferView:
    if not tensor.is_contiguous():
        raise ValueError("torch tensor is not contiguous; call .contiguous() before registering")
    num_bytes = tensor.numel() * tensor.element_size()
    address = tensor.data_ptr()
    if tensor.device.type == "cuda":
        return BufferView(
            None, address, num_bytes, location or f"cuda:{tensor.device.index}", tensor
        )
    if tensor.device.type != "cpu":
        raise ValueError(f"torch tensors on {tensor.device} cannot be registered (cpu or cuda)")
    # NOTE: a ctypes array over the tensor's storage works for every dtype (bfloat16 too,
    # which numpy cannot represent); the BufferView keeps the tensor alive.
    mv = (
        memoryview((ctypes.c_ubyte * num_bytes).from_address(address)).cast("B")
        if num_bytes
        else memoryview(bytearray())
    )
    return BufferView(mv, address, num_bytes, location or "cpu:0", tensor)


def buffer_view(obj: Any, location: str | None = None) -> BufferView:
    """The bytes of `obj` (numpy array, torch tensor, bytearray, mmap, memoryview).

    Raises ValueError when the buffer is read-only or not contiguous, since a transfer engine
    must be able to write into every registered region. Does not copy.
    """
    if _is_torch_tensor(obj):
        return _torch_view(obj, location)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("numpy array is not C-contiguous; use np.ascontiguousarray first")
        if not obj.flags.writeable:
            raise ValueError("numpy array is read-only; registered memory must be writable")
        flat = obj.reshape(-1).view(np.uint8)
        mv = memoryview(flat)  # type: ignore[arg-type]
    else:
        try:
            mv = memoryview(obj)
        except TypeError as e:
            raise ValueError(f"cannot register a {type(obj).__name__}: no buffer protocol") from e
        if not mv.c_contiguous:
            raise ValueError(f"{type(obj).__name__} buffer is not contiguous")
        if mv.readonly:
            raise ValueError(f"{type(obj).__name__} buffer is read-only")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    return BufferView(mv, address_of(mv), mv.nbytes, location or "cpu:0", obj)


def as_array(view: BufferView) -> np.ndarray:
    """A uint8 numpy array sharing the memory of a host `view` (no copy)."""
    if view.mv is None:
        raise ValueError(f"memory at {view.location} is not host-addressable")
    return np.frombuffer(view.mv, dtype=np.uint8)
