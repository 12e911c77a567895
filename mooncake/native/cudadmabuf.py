"""A dma-buf file descriptor for a range of CUDA device memory, for RDMA registration
without nvidia-peermem (`ibv_reg_dmabuf_mr`, Linux 5.12+ and CUDA 11.7+ drivers).

`export_dmabuf` calls the CUDA driver's `cuMemGetHandleForAddressRange` with
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD through ctypes (no toolkit needed, only libcuda). The
range must be host-page aligned, so it exports the enclosing pages and returns the offset
of `address` within them. The caller closes the descriptor once the MR is registered (the
kernel keeps its own reference).
"""

from __future__ import annotations

import ctypes
import mmap

from mooncake.errors import TransferError

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def export_dmabuf(address: int, length: int) -> tuple[int, int]:
    """(fd, offset of `address` in it) of the pages holding [address, address+length)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise TransferError(f"dma-buf export needs the CUDA driver (libcuda.so.1): {e}") from e
    page = mmap.PAGESIZE
    base = address & ~(page - 1)
    size = -(-(address + length - base) // page) * page
    fd = ctypes.c_int(-1)
    get = cuda.cuMemGetHandleForAddressRange
    get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_ulonglong,
    ]
    rc = get(ctypes.byref(fd), base, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if rc != 0 or fd.value < 0:
        raise TransferError(
            f"cuMemGetHandleForAddressRange(DMA_BUF_FD) failed with CUresult {rc}: dma-buf "
            "needs a CUDA 11.7+ driver with dma-buf support and Linux 5.12+; or load "
            "nvidia-peermem (modprobe nvidia-peermem)"
        )
    return fd.value, address - base
