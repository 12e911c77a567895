"""What hardware this node has, and which RDMA NIC each memory location should use.

`detect_topology()` gathers runtime facts (NUMA nodes, GPUs, RDMA NICs, network interfaces,
disks, filesystems) into one frozen `Topology`; nothing is written to config. Its
`nic_preference` is the priority matrix of upstream Mooncake's Transfer Engine: for every
location ("cpu:N" per NUMA node, "cuda:N" per GPU) the NICs to use first and the rest.

Rules (NICs are only those with an ACTIVE port and, if given, on the allow-list):
- cpu:N prefers the NICs on NUMA node N; every other NIC is available.
- cuda:N prefers, among the NICs on the GPU's NUMA node, those at the smallest PCIe distance
  (hops from each device up to their common ancestor); when that node has no NIC (or the
  GPU's node is unknown) it prefers the nearest NICs over all. Every other NIC is available.
- A NIC whose NUMA node is unknown (sysfs -1 on a multi-node host) is preferred by no cpu:N
  but stays a candidate for GPUs, where PCIe distance decides. On a one-node host unknown
  means that node.
Lists are in natural name order (mlx5_2 before mlx5_10).

Only sysfs facts come from `sysfs_root`; NVML, psutil and pyverbs facts are the live host's.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import psutil

from mooncake.native import nvml as nvml_reader
from mooncake.native import sysfs, verbs_info
from mooncake.native.nvml import GpuInfo
from mooncake.native.sysfs import DiskInfo, FilesystemInfo, NicInfo, NicPort, NumaNode

__all__ = [
    "DiskInfo",
    "FilesystemInfo",
    "GpuInfo",
    "NetInterface",
    "NicInfo",
    "NicPort",
    "NicPreference",
    "NumaNode",
    "Topology",
    "compute_nic_preference",
    "detect_topology",
    "pci_distance",
]

log = logging.getLogger(__name__)


class NicPreference(msgspec.Struct, frozen=True):
    """Which NICs a location should use: `preferred` first, `available` on retry."""

    preferred: list[str]  # NIC names nearest the location; may be empty for a cpu:N
    available: list[str]  # every other usable NIC


class NetInterface(msgspec.Struct, frozen=True):
    """A network interface as psutil sees it (loopback and down ones included)."""

    name: str
    addresses: list[str]  # IPv4 and IPv6 addresses
    mac: str  # "" when the interface has none
    speed_mbps: int  # link speed; 0 when the driver does not say
    mtu: int  # bytes
    is_up: bool


class Topology(msgspec.Struct, frozen=True):
    """Runtime hardware facts of one node (never part of config)."""

    hostname: str
    cpu_count: int  # logical CPUs
    memory_total_bytes: int
    memory_available_bytes: int  # what the OS could give without swapping
    numa_nodes: list[NumaNode]
    gpus: list[GpuInfo]
    nics: list[NicInfo]  # every RDMA device, usable or not (see NicInfo.is_active)
    net_interfaces: list[NetInterface]
    disks: list[DiskInfo]
    filesystems: list[FilesystemInfo]
    nic_preference: dict[str, NicPreference]  # "cpu:0", "cuda:3" -> NICs to use
    notes: list[str]  # plain-language facts: what is missing and why

    @property
    def usable_nic_names(self) -> list[str]:
        """NICs that appear in the preference matrix (active, allowed)."""
        names = {n for p in self.nic_preference.values() for n in p.preferred + p.available}
        return sorted(names, key=sysfs.natural_key)

    def nics_for(self, location: str) -> NicPreference:
        """The preference of `location`; an unknown location may use any usable NIC."""
        return self.nic_preference.get(location) or NicPreference(self.usable_nic_names, [])


def pci_distance(path_a: Sequence[str], path_b: Sequence[str]) -> int | None:
    """PCIe hops between two devices: from each up to their deepest common ancestor.

    Devices under different root complexes have no common ancestor; their distance is the
    sum of both path lengths. None when either path is unknown (not a PCI device).
    """
    if not path_a or not path_b:
        return None
    common = 0
    for a, b in zip(path_a, path_b, strict=False):
        if a != b:
            break
        common += 1
    return len(path_a) + len(path_b) - 2 * common


def _names(nics: list[NicInfo]) -> list[str]:
    return sorted((n.name for n in nics), key=sysfs.natural_key)


def _gpu_preference(gpu: GpuInfo, nics: list[NicInfo]) -> NicPreference:
    same_node = [n for n in nics if n.numa_node in (gpu.numa_node, None)]
    if gpu.numa_node is None or not any(n.numa_node == gpu.numa_node for n in nics):
        same_node = nics  # nothing known to be local: nearest over all
    distance = {n.name: pci_distance(gpu.pci_path, n.pci_path) for n in same_node}
    known = [d for d in distance.values() if d is not None]
    nearest = min(known) if known else None
    preferred = [n for n in same_node if distance[n.name] == nearest]
    return NicPreference(_names(preferred), _names([n for n in nics if n not in preferred]))


def compute_nic_preference(
    numa_ids: Sequence[int], gpus: Sequence[GpuInfo], nics: Sequence[NicInfo]
) -> dict[str, NicPreference]:
    """The priority matrix over usable `nics`: "cpu:N" for each NUMA node, then "cuda:N".

    Pure function; see the module docstring for the rules.
    """
    usable = list(nics)
    matrix: dict[str, NicPreference] = {}
    for node in numa_ids:
        local = [n for n in usable if n.numa_node == node]
        matrix[f"cpu:{node}"] = NicPreference(
            _names(local), _names([n for n in usable if n not in local])
        )
    for gpu in gpus:
        matrix[f"cuda:{gpu.index}"] = _gpu_preference(gpu, usable)
    return matrix


def _usable_nics(
    nics: list[NicInfo], nic_allow: Sequence[str] | None
) -> tuple[list[NicInfo], list[str]]:
    notes = []
    for nic in nics:
        if not nic.is_active:
            states = ", ".join(f"port {p.port}: {p.state}" for p in nic.ports) or "no ports"
            notes.append(f"{nic.name} is not used: no ACTIVE port ({states})")
    usable = [n for n in nics if n.is_active]
    if nic_allow:
        unknown = [name for name in nic_allow if name not in {n.name for n in nics}]
        if unknown:
            found = ", ".join(_names(nics)) or "none"
            notes.append(
                f"NIC allow-list names {', '.join(unknown)}: no such RDMA NIC (found: {found})"
            )
        left_out = [n for n in usable if n.name not in nic_allow]
        if left_out:
            notes.append(f"left out by the NIC allow-list: {', '.join(_names(left_out))}")
        usable = [n for n in usable if n.name in nic_allow]
    if nics and not usable:
        notes.append("no usable RDMA NIC: the rdma transport has no path here")
    return usable, notes


def _verbs_notes(nics: list[NicInfo], verbs: Any | None) -> list[str]:
    info = verbs_info.read_verbs_devices(verbs)
    if not info.is_installed:
        why = "pyverbs not installed (Debian: apt install python3-pyverbs)"
        return [f"{why}: the rdma transport cannot use the RDMA NICs"]
    unseen = [n.name for n in nics if n.is_active and n.name not in info.device_names]
    if unseen:
        why = f" ({info.reason})" if info.reason else ""
        return [f"libibverbs does not list {', '.join(unseen)}{why}: userspace provider missing?"]
    return []


def _net_interfaces() -> list[NetInterface]:
    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    result = []
    for name in sorted(set(stats) | set(addrs)):
        entries = addrs.get(name, [])
        ips = [a.address for a in entries if a.family in (socket.AF_INET, socket.AF_INET6)]
        macs = [a.address for a in entries if a.family == psutil.AF_LINK]
        st = stats.get(name)
        result.append(
            NetInterface(
                name=name,
                addresses=ips,
                mac=macs[0] if macs else "",
                speed_mbps=st.speed if st else 0,
                mtu=st.mtu if st else 0,
                is_up=bool(st and st.isup),
            )
        )
    return result


def _with_numa(item: Any, node: int) -> Any:
    return msgspec.structs.replace(item, numa_node=node) if item.numa_node is None else item


def detect_topology(
    sysfs_root: Path = sysfs.DEFAULT_SYSFS_ROOT,
    nvml: Any | None = None,
    nic_allow: Sequence[str] | None = None,
    verbs: Any | None = None,
) -> Topology:
    """Detect this node's hardware. Reads only; never raises for missing hardware.

    `nvml` is the pynvml seam (None: the real module, if installed); `nic_allow` is
    config's transfer.nics (None or empty: every NIC); `verbs` is the pyverbs.device seam,
    consulted only for the real /sys or when given. What is missing goes into `notes`.
    """
    notes: list[str] = []
    memory = psutil.virtual_memory()
    numa_nodes = sysfs.read_numa_nodes(sysfs_root)
    if not numa_nodes:
        numa_nodes = [NumaNode(0, list(range(os.cpu_count() or 1)), memory.total, memory.available)]
        notes.append(
            f"no NUMA information ({sysfs_root}/devices/system/node absent): one node assumed"
        )
    gpus, gpu_notes = nvml_reader.read_gpus(nvml, sysfs_root)
    notes += gpu_notes
    nics = sysfs.read_rdma_nics(sysfs_root)
    if nics is None:
        notes.append(f"no RDMA NIC found ({sysfs_root}/class/infiniband absent)")
    elif not nics:
        notes.append(f"no RDMA NIC found ({sysfs_root}/class/infiniband is empty)")
    nics = nics or []
    if len(numa_nodes) == 1:  # unknown NUMA on a one-node host can only mean that node
        gpus = [_with_numa(g, numa_nodes[0].id) for g in gpus]
        nics = [_with_numa(n, numa_nodes[0].id) for n in nics]
    else:
        unknown = [f"GPU {g.index}" for g in gpus if g.numa_node is None]
        unknown += [n.name for n in nics if n.numa_node is None]
        if unknown:  # firmware gave no PCI affinity (sysfs numa_node -1)
            notes.append(f"NUMA node unknown (sysfs numa_node -1) for {', '.join(unknown)}")
    usable, nic_notes = _usable_nics(nics, nic_allow)
    notes += nic_notes
    if nics and (verbs is not None or sysfs_root == sysfs.DEFAULT_SYSFS_ROOT):
        notes += _verbs_notes(nics, verbs)
    return Topology(
        hostname=socket.gethostname(),
        cpu_count=os.cpu_count() or 1,
        memory_total_bytes=memory.total,
        memory_available_bytes=memory.available,
        numa_nodes=numa_nodes,
        gpus=gpus,
        nics=nics,
        net_interfaces=_net_interfaces(),
        disks=sysfs.read_disks(sysfs_root),
        filesystems=sysfs.read_filesystems(sysfs_root),
        nic_preference=compute_nic_preference([n.id for n in numa_nodes], gpus, usable),
        notes=notes,
    )
