"""Raw readers of Linux sysfs: RDMA NICs, PCI devices, NUMA nodes, block devices, filesystems.

Every reader takes `sysfs_root` (default /sys) so tests feed recorded trees. Readers return
the facts as found and decide nothing: which NIC is usable or preferred is
mooncake/hw/topology.py's business.

NUMA: sysfs reports -1 when the firmware gave no affinity (usual on one-socket machines).
Readers return None for it ("unknown"); hw/topology.py turns None into the only node of a
one-node host and otherwise leaves it unknown.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import msgspec
import psutil

log = logging.getLogger(__name__)

DEFAULT_SYSFS_ROOT = Path("/sys")
SECTOR_BYTES = 512  # /sys/block/*/size counts 512-byte sectors whatever the device's block size
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")  # 0000:17:00.0
_ROOT_COMPLEX = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")  # pci0000:16
_VIRTUAL_BLOCK = ("loop", "ram", "zram")  # memory- or file-backed: never a place for an SSD tier


class PciDevice(msgspec.Struct, frozen=True):
    """A PCI function as sysfs sees it."""

    bus_id: str  # "0000:17:00.0" (sysfs form: 4-digit domain, lower case)
    numa_node: int | None  # None when sysfs says -1 or has no numa_node file
    pci_path: list[str]  # root complex down to the device: ["pci0000:16", "0000:16:02.0", ...]


class NicPort(msgspec.Struct, frozen=True):
    """One port of an RDMA device (/sys/class/infiniband/<dev>/ports/<port>)."""

    port: int  # port number, from 1
    state: str  # "ACTIVE", "DOWN", "INIT", "ARMED", ... (the text after "4: ")
    is_active: bool  # state == ACTIVE: the only state that can carry traffic
    rate_gbps: float  # Gb/s the port reports ("200 Gb/sec (4X HDR)" -> 200.0); 0.0 if unreadable
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    gid: str  # GID index 0 ("fe80:0000:..."); "" if absent


class NicInfo(msgspec.Struct, frozen=True):
    """An RDMA device (HCA / RNIC) with its ports and where it sits on the PCIe tree."""

    name: str  # "mlx5_0"
    pci_bus_id: str  # "0000:0c:00.0"; "" for a software device (rxe, siw) with no PCI function
    numa_node: int | None  # None = unknown (sysfs -1 or no PCI function)
    ports: list[NicPort]
    pci_path: list[str] = []  # root complex down to the NIC; [] when not on PCI
    netdevs: list[str] = []  # network interfaces of the same PCI function ("ibp12s0", "ens1f0")
    is_active: bool = False  # at least one port ACTIVE; only such NICs carry transfers


class NumaNode(msgspec.Struct, frozen=True):
    """A NUMA node with its CPUs and memory (/sys/devices/system/node/nodeN)."""

    id: int
    cpus: list[int]  # logical CPU ids; empty for a memory-only node
    memory_total_bytes: int
    memory_free_bytes: int


class DiskInfo(msgspec.Struct, frozen=True):
    """A block device that could back an SSD tier (/sys/block/<name>)."""

    name: str  # "nvme0n1", "sda", "dm-0"
    size_bytes: int
    is_rotational: bool  # spinning disk (or a virtual disk that says so)
    is_removable: bool
    model: str  # "SAMSUNG MZWLJ3T8HBLS-00007"; "" when the device does not say


class FilesystemInfo(msgspec.Struct, frozen=True):
    """A mounted filesystem, where an SSD-tier file could live."""

    mountpoint: str
    device: str  # "/dev/nvme0n1p1"
    fstype: str  # "ext4", "xfs", ...
    total_bytes: int
    free_bytes: int  # free for an unprivileged user
    disk: str  # backing block device ("nvme0n1"); "" when unknown (overlay, network fs)
    is_rotational: bool | None  # of the backing disk; None when unknown


def read_text(path: Path) -> str | None:
    """The stripped content of a sysfs attribute, or None if it cannot be read."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = read_text(path)
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def _numa(path: Path) -> int | None:
    node = _read_int(path)
    return node if node is not None and node >= 0 else None


def pci_path_of(device_dir: Path) -> list[str]:
    """Bus ids from the root complex down, read off the realpath of a sysfs device dir."""
    parts = os.path.realpath(device_dir).split(os.sep)
    starts = [i for i, p in enumerate(parts) if _ROOT_COMPLEX.match(p)]
    if not starts:
        return []  # a virtual device (/sys/devices/virtual/...)
    # NOTE: keep nested root complexes (Intel VMD puts a pci10000:e0 domain under a BDF).
    return [p for p in parts[starts[0] :] if _BDF.match(p) or _ROOT_COMPLEX.match(p)]


def read_pci_device(bus_id: str, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> PciDevice | None:
    """The NUMA node and PCI path of `bus_id` ("0000:17:00.0"), or None if sysfs lacks it."""
    device_dir = sysfs_root / "bus" / "pci" / "devices" / bus_id
    if not device_dir.exists():
        return None
    return PciDevice(bus_id, _numa(device_dir / "numa_node"), pci_path_of(device_dir))


def _read_port(port_dir: Path) -> NicPort:
    state_text = read_text(port_dir / "state") or "0: UNKNOWN"  # "4: ACTIVE"
    state = state_text.split(":", 1)[-1].strip()
    rate_text = read_text(port_dir / "rate") or ""  # "200 Gb/sec (4X HDR)"
    try:
        rate_gbps = float(rate_text.split()[0])
    except (IndexError, ValueError):
        rate_gbps = 0.0
    return NicPort(
        port=int(port_dir.name),
        state=state,
        is_active=state == "ACTIVE",
        rate_gbps=rate_gbps,
        link_layer=read_text(port_dir / "link_layer") or "",
        gid=read_text(port_dir / "gids" / "0") or "",
    )


def _read_nic(dev_dir: Path) -> NicInfo:
    ports_dir = dev_dir / "ports"
    port_dirs = [p for p in ports_dir.iterdir() if p.name.isdigit()] if ports_dir.is_dir() else []
    ports = [_read_port(p) for p in sorted(port_dirs, key=lambda p: int(p.name))]
    pci_dir = dev_dir / "device"
    if not pci_dir.exists():  # software RDMA (rxe, siw) lives under /sys/devices/virtual
        return NicInfo(dev_dir.name, "", None, ports, is_active=any(p.is_active for p in ports))
    net_dir = pci_dir / "net"
    return NicInfo(
        name=dev_dir.name,
        pci_bus_id=os.path.basename(os.path.realpath(pci_dir)),
        numa_node=_numa(pci_dir / "numa_node"),
        ports=ports,
        pci_path=pci_path_of(pci_dir),
        netdevs=sorted(p.name for p in net_dir.iterdir()) if net_dir.is_dir() else [],
        is_active=any(p.is_active for p in ports),
    )


def read_rdma_nics(sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[NicInfo] | None:
    """Every RDMA device under /sys/class/infiniband, sorted by name.

    Returns None when the class directory is absent (no RDMA driver loaded), [] when present
    but empty. Reads only; changes nothing.
    """
    class_dir = sysfs_root / "class" / "infiniband"
    if not class_dir.is_dir():
        return None
    return [_read_nic(d) for d in sorted(class_dir.iterdir(), key=lambda d: natural_key(d.name))]


def parse_cpulist(text: str) -> list[int]:
    """Expand a kernel cpulist ("0-3,8,10-11") into CPU ids."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def nic_numa_cpus(nic: str, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[int]:
    """The CPUs of the NUMA node RDMA device `nic` is attached to; [] when sysfs does not
    say (no such device, a software device, numa_node -1, a node without CPUs)."""
    dev_dir = sysfs_root / "class" / "infiniband" / nic
    node = _numa(dev_dir / "device" / "numa_node") if dev_dir.exists() else None
    if node is None:
        return []
    cpus = read_text(sysfs_root / "devices" / "system" / "node" / f"node{node}" / "cpulist")
    return parse_cpulist(cpus or "")


def _meminfo_bytes(text: str, key: str) -> int:
    for line in text.splitlines():  # "Node 0 MemTotal:       528212012 kB"
        fields = line.split()
        if len(fields) >= 4 and fields[2] == f"{key}:":
            return int(fields[3]) * 1024
    return 0


def read_numa_nodes(sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[NumaNode]:
    """NUMA nodes from /sys/devices/system/node/node*, sorted by id; [] if sysfs has none."""
    node_dir = sysfs_root / "devices" / "system" / "node"
    if not node_dir.is_dir():
        return []
    nodes = []
    for d in node_dir.iterdir():
        if not (d.name.startswith("node") and d.name[4:].isdigit()):
            continue
        meminfo = read_text(d / "meminfo") or ""
        nodes.append(
            NumaNode(
                id=int(d.name[4:]),
                cpus=parse_cpulist(read_text(d / "cpulist") or ""),
                memory_total_bytes=_meminfo_bytes(meminfo, "MemTotal"),
                memory_free_bytes=_meminfo_bytes(meminfo, "MemFree"),
            )
        )
    return sorted(nodes, key=lambda n: n.id)


def read_disks(sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[DiskInfo]:
    """Block devices from /sys/block, without loop/ram/zram devices and empty ones (card
    readers without a card), sorted by name."""
    block_dir = sysfs_root / "block"
    if not block_dir.is_dir():
        return []
    disks = []
    for d in sorted(block_dir.iterdir(), key=lambda d: natural_key(d.name)):
        size_bytes = (_read_int(d / "size") or 0) * SECTOR_BYTES
        if d.name.startswith(_VIRTUAL_BLOCK) or size_bytes == 0:
            continue
        disks.append(
            DiskInfo(
                name=d.name,
                size_bytes=size_bytes,
                is_rotational=_read_int(d / "queue" / "rotational") == 1,
                is_removable=_read_int(d / "removable") == 1,
                model=read_text(d / "device" / "model") or "",
            )
        )
    return disks


def disk_of(device: str, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> str:
    """The whole-disk name behind a device node ("/dev/nvme0n1p2" -> "nvme0n1"), or ""."""
    name = os.path.basename(os.path.realpath(device))  # /dev/mapper/vg-lv -> dm-0
    entry = sysfs_root / "class" / "block" / name
    if not entry.exists():
        return ""
    if (entry / "partition").exists():
        return os.path.basename(os.path.dirname(os.path.realpath(entry)))
    return name


def read_filesystems(
    sysfs_root: Path = DEFAULT_SYSFS_ROOT, mounts: Path | None = None
) -> list[FilesystemInfo]:
    """Mounted local filesystems with their size and free space (psutil), sorted by mountpoint.

    A mount whose usage cannot be read (permission, stale network mount) is left out and
    logged. The backing disk is looked up in `sysfs_root`. `mounts`: a mount table in
    /proc/self/mounts format to read instead of psutil's (its device-backed lines).
    """
    result = []
    for device, mountpoint, fstype in _mount_table(mounts):
        try:
            usage = psutil.disk_usage(mountpoint)
        except OSError as e:
            log.info("skipping filesystem %s: %s", mountpoint, e)
            continue
        disk = disk_of(device, sysfs_root) if device.startswith("/dev/") else ""
        rotational = (
            _read_int(sysfs_root / "block" / disk / "queue" / "rotational") if disk else None
        )
        result.append(
            FilesystemInfo(
                mountpoint=mountpoint,
                device=device,
                fstype=fstype,
                total_bytes=usage.total,
                free_bytes=usage.free,
                disk=disk,
                is_rotational=None if rotational is None else rotational == 1,
            )
        )
    return sorted(result, key=lambda f: f.mountpoint)


def _mount_table(mounts: Path | None) -> list[tuple[str, str, str]]:
    """(device, mountpoint, fstype) of mounted local filesystems."""
    if mounts is None:
        return [(p.device, p.mountpoint, p.fstype) for p in psutil.disk_partitions(all=False)]
    table = []
    for line in mounts.read_text().splitlines():
        device, point, fstype = line.split()[:3]
        if device.startswith("/dev/"):
            table.append((device, point.replace("\\040", " "), fstype))
    return table


def natural_key(name: str) -> list[int | str]:
    """Sort key that orders mlx5_2 before mlx5_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class GidEntry(msgspec.Struct, frozen=True):
    """One populated entry of a port's GID table (ports/<p>/gids/<i>, gid_attrs/types/<i>)."""

    index: int
    gid: str  # "0000:0000:0000:0000:0000:ffff:0a00:0007" (an IPv4-mapped RoCE v2 GID)
    gid_type: str  # "RoCE v2", "IB/RoCE v1"; "" when the kernel does not say

    @property
    def is_roce_v2_ipv4(self) -> bool:
        """A RoCE v2 GID made from an IPv4 address: routable over an L3 fabric."""
        return self.gid_type == "RoCE v2" and self.gid.startswith("0000:0000:0000:0000:0000:ffff:")


def read_gid_table(nic: str, port: int, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[GidEntry]:
    """The non-zero GIDs of `nic`'s `port` with their types, by index."""
    port_dir = sysfs_root / "class" / "infiniband" / nic / "ports" / str(port)
    gids_dir = port_dir / "gids"
    if not gids_dir.is_dir():
        return []
    entries = []
    for path in sorted(
        (p for p in gids_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    ):
        gid = read_text(path) or ""
        if gid and gid.strip("0:"):
            kind = read_text(port_dir / "gid_attrs" / "types" / path.name) or ""
            entries.append(GidEntry(int(path.name), gid, kind))
    return entries


def read_netdev_mtu(netdev: str, sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> int | None:
    """The MTU of network interface `netdev` in bytes, or None when unreadable."""
    return _read_int(sysfs_root / "class" / "net" / netdev / "mtu")
