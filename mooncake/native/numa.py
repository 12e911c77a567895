"""Placing host memory on a NUMA node: the node of the NIC or GPU that will move it.

A pool arena read by a NIC on socket 1 but faulted in on socket 0 crosses the socket link
on every transfer. `prefer` sets the memory policy of an arena's pages, before they are
first touched, to MPOL_PREFERRED on that node with mbind(2) (libc's syscall(); no libnuma
needed): the kernel allocates there while it can, elsewhere rather than failing. Best
effort: where the call is unavailable (another architecture, a seccomp filter, a kernel
without NUMA) it says why and the memory stays wherever first touch puts it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform

import numpy as np

from mooncake.native.sysfs import parse_cpulist

log = logging.getLogger(__name__)

MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}  # syscall numbers per arch
_warned: set[str] = set()


def prefer(array: np.ndarray, node: int) -> str:
    """Ask the kernel to place the pages of `array` (page-aligned, not yet touched) on NUMA
    node `node`; returns "" when it accepted, else why not (also logged once per reason)."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        return _warn(f"NUMA placement not supported on {platform.machine()}")
    address, num_bytes = array.ctypes.data, array.nbytes
    if address % mmap.PAGESIZE or num_bytes == 0:
        return _warn("NUMA placement needs a page-aligned, non-empty buffer")
    num_longs = node // 64 + 1
    mask = (ctypes.c_ulong * num_longs)()
    mask[node // 64] = 1 << (node % 64)
    length = -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(MPOL_PREFERRED),
        mask,
        ctypes.c_ulong(num_longs * 64 + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        return _warn(f"mbind to NUMA node {node} failed: {os.strerror(err)}")
    return ""


def num_nodes(sysfs_root: str = "/sys") -> int:
    """NUMA nodes online (1 when the kernel does not say)."""
    try:
        with open(f"{sysfs_root}/devices/system/node/online") as f:
            return len(parse_cpulist(f.read().strip()))
    except OSError:
        return 1


def place(array: np.ndarray, location: str) -> None:
    """Place a new host arena for `location` ("cpu:N": NUMA node N) on its node, on a host
    of several nodes (best effort, see `prefer`)."""
    kind, _, index = location.partition(":")
    if kind == "cpu" and index.isdigit() and num_nodes() > 1 and not prefer(array, int(index)):
        log.debug("host arena of %d bytes placed on NUMA node %s", array.nbytes, index)


def _warn(why: str) -> str:
    if why not in _warned:
        _warned.add(why)
        log.warning("%s: host arenas stay where first touched (slower across sockets)", why)
    return why
