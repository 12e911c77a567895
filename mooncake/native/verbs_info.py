"""Optional pyverbs view of the RDMA devices: what libibverbs (and so the rdma transport) sees.

sysfs alone is enough for topology; this only answers "can the rdma transport open these
NICs?". A NIC in sysfs that libibverbs does not list has no userspace provider (rdma-core's
libmlx5 etc. missing). pyverbs is Debian's python3-pyverbs or PyPI's pyverbs; it may be
absent, and with no RDMA device it may raise PyverbsRDMAError: both are normal answers.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import msgspec

log = logging.getLogger(__name__)


class VerbsInfo(msgspec.Struct, frozen=True):
    """What pyverbs reports."""

    is_installed: bool  # pyverbs importable
    device_names: list[str]  # devices libibverbs lists, sorted
    reason: str  # why device_names is empty ("pyverbs not installed", "no RDMA devices"); "" else


def read_verbs_devices(pyverbs_device: Any | None = None) -> VerbsInfo:
    """List RDMA devices through `pyverbs.device.get_device_list()`; never raises.

    `pyverbs_device` is the seam for the `pyverbs.device` module (None: load pyverbs the way
    the rdma transport does, Debian's python3-pyverbs included).
    """
    if pyverbs_device is None:
        from mooncake.native import rdma

        try:
            pyverbs_device = rdma.load_pyverbs()
        except ImportError:
            return VerbsInfo(False, [], "pyverbs not installed")
    try:
        devices = pyverbs_device.get_device_list()
    # NOTE: pyverbs raises PyverbsRDMAError when ibv_get_device_list fails (no RDMA kernel
    # support, no device); any failure here means "no devices", never a crash of detection.
    except Exception as e:
        log.info("pyverbs get_device_list failed: %s", e)
        return VerbsInfo(True, [], f"no RDMA devices ({e})")
    names = sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)
    return VerbsInfo(True, names, "" if names else "no RDMA devices")


IBV_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu -> bytes


def read_active_mtus(
    ports: list[tuple[str, int]], pyverbs_device: Any | None = None
) -> dict[tuple[str, int], int]:
    """(device, port) -> the port's active MTU in bytes (ibv_query_port), for the ports
    pyverbs can open; never raises (an unreadable port is left out)."""
    device = pyverbs_device
    if device is None:
        from mooncake.native import rdma

        try:
            rdma.load_pyverbs()  # NOTE: puts Debian's python3-pyverbs on the path if needed
            device = importlib.import_module("pyverbs.device")
        except ImportError:
            return {}
    mtus = {}
    for name, port in ports:
        try:
            ctx = device.Context(name=name)
            try:
                mtus[(name, port)] = IBV_MTU_BYTES.get(int(ctx.query_port(port).active_mtu), 0)
            finally:
                ctx.close()
        except Exception as e:  # NOTE: PyverbsRDMAError and friends: this port is unknown
            log.info("pyverbs query_port(%s, %d) failed: %s", name, port, e)
    return mtus
