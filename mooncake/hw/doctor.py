"""`mooncake doctor`: is this node ready to serve? Each check passes, warns or fails, and
says the fix in one line; a check that does not apply here (no GPU to map) is skipped.

The checks read recorded facts (`Facts`: sysfs, NVML through the topology, the
environment, limits), so tests feed recorded machines; `gather` takes them from this host.
Hardware: the NVIDIA driver and NVML (a GPU torch sees but NVML does not report fails),
CUDA_VISIBLE_DEVICES against NVML, each RDMA device
(port state, link layer, a RoCE v2 GID, active MTU), GPU memory registration (nvidia-peermem
or dma-buf), RLIMIT_MEMLOCK, and each GPU's NIC (PCIe and NUMA pairing). With a config
(`check_config`): the SSD tier's path, the ports, and the master with the cluster secret.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from mooncake.hw.topology import Topology, detect_topology, pci_distance
from mooncake.native import cudamap, sysfs, verbs_info
from mooncake.native.sysfs import GidEntry, NicInfo

Status = Literal["pass", "warn", "fail", "skip"]
IB_MTUS = (256, 512, 1024, 2048, 4096)  # bytes, the MTUs an RDMA port can run
ROCE_HEADERS_BYTES = 96  # GRH, UDP, BTH, extended headers and ICRC inside a RoCE frame
DMABUF_KERNEL = (5, 12)  # first kernel with ibv_reg_dmabuf_mr
DMABUF_DRIVER = 515  # first NVIDIA driver that exports GPU memory as dma-buf


class Check(msgspec.Struct, frozen=True):
    """One readiness check's outcome."""

    name: str  # "nvidia driver", "rdma mlx5_0", ...
    status: Status
    detail: str  # what was found
    fix: str = ""  # one line: what to do ("" when it passes or is skipped)


@dataclass(frozen=True)
class Facts:
    """What the hardware checks look at."""

    topology: Topology
    sysfs_root: Path
    env: Mapping[str, str]  # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER
    memlock_bytes: int | None  # soft RLIMIT_MEMLOCK; None = unlimited
    torch_uuids: list[str] | None = None  # what torch sees, when it has CUDA
    kernel: tuple[int, int] = (0, 0)  # running kernel's (major, minor)
    has_pyverbs: bool = False
    # (device, port) -> active MTU in bytes, as ibv_query_port says (pyverbs); {} unknown
    verbs_mtus: Mapping[tuple[str, int], int] = field(default_factory=dict)
    has_rdma_loop: bool = True  # the RDMA C data loop (native/_rdmaloop.c) was built


def gather(sysfs_root: Path = sysfs.DEFAULT_SYSFS_ROOT) -> Facts:
    """This host's facts (reads only)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    major, minor = (platform.release().split(".") + ["0", "0"])[:2]
    topology = detect_topology(sysfs_root)
    ports = [(n.name, p.port) for n in topology.nics for p in n.ports if p.is_active]
    return Facts(
        topology=topology,
        sysfs_root=sysfs_root,
        env=dict(os.environ),
        memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
        torch_uuids=cudamap.torch_uuids(),
        kernel=(int(major), int("".join(c for c in minor if c.isdigit()) or 0)),
        has_pyverbs=verbs_info.read_verbs_devices(None).is_installed,
        verbs_mtus=verbs_info.read_active_mtus(ports) if ports else {},
        has_rdma_loop=importlib.util.find_spec("mooncake.native._rdmaloop") is not None,
    )


def check_node(f: Facts) -> list[Check]:
    """Every hardware check, in the order a reader fixes them."""
    checks = [_driver(f), _cuda_map(f)]
    checks += _rdma(f) if f.topology.nics else [_no_rdma(f)]
    return [*checks, _gpu_registration(f), _memlock(f), *_pairing(f)]


def _module_text(f: Facts, module: str, attr: str) -> str | None:
    return sysfs.read_text(f.sysfs_root / "module" / module / attr)


def _driver(f: Facts) -> Check:
    gpus, version = f.topology.gpus, _module_text(f, "nvidia", "version")
    notes = "; ".join(n for n in f.topology.notes if "GPU" in n)
    if gpus:
        names = sorted({g.name for g in gpus})
        return Check(
            "nvidia driver",
            "pass",
            f"driver {version or '?'}, NVML sees {len(gpus)} GPUs ({', '.join(names)})",
        )
    if f.torch_uuids:  # NOTE: a node uses this GPU all the same, blind to its placement
        missing = "pynvml not installed" in notes
        return Check(
            "nvidia driver",
            "fail",
            f"torch sees {len(f.torch_uuids)} CUDA devices but {notes or 'NVML reports none'}: "
            "nodes run on cuda:0 without NVML's facts (its NUMA node, nearest NICs, memory)",
            "pip install nvidia-ml-py"
            if missing
            else "make NVML's library load (libnvidia-ml.so.1 of the driver; in a container "
            "the NVIDIA runtime mounts it), then check `nvidia-smi` lists the GPUs",
        )
    if version:
        return Check(
            "nvidia driver",
            "fail",
            f"driver {version} loaded but {notes}",
            "pip install nvidia-ml-py, then check `nvidia-smi` lists the GPUs",
        )
    return Check(
        "nvidia driver",
        "warn",
        notes or "no NVIDIA GPU",
        "none on a CPU node; on a GPU node install the NVIDIA driver and nvidia-ml-py",
    )


def _cuda_map(f: Facts) -> Check:
    gpus = f.topology.gpus
    if not gpus:
        return Check("cuda devices", "skip", "no GPU to map")
    value = f.env.get("CUDA_VISIBLE_DEVICES")
    by_env = cudamap.visible_gpus(gpus, f.env)
    shown = ", ".join(f"cuda:{i} = GPU {g.index} ({g.pci_bus_id})" for i, g in enumerate(by_env))
    if value is not None:
        entries = [e for e in value.split(",") if e.strip()]
        if len(by_env) < len(entries) or (value.strip() and not by_env):
            bad = entries[len(by_env)] if len(by_env) < len(entries) else value
            return Check(
                "cuda devices",
                "fail",
                f"CUDA_VISIBLE_DEVICES={value}: {bad!r} names no GPU, so CUDA stops "
                f"there ({shown or 'no GPU visible'})",
                "list NVML indices or UUIDs that exist (`nvidia-smi -L`)",
            )
    if f.torch_uuids is not None:
        by_torch = cudamap.visible_gpus(gpus, f.env, f.torch_uuids)
        if by_torch != by_env:
            return Check(
                "cuda devices",
                "warn",
                f"torch orders the GPUs otherwise than NVML ({shown})",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
            )
    if len({g.name for g in gpus}) > 1 and f.env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return Check(
            "cuda devices",
            "warn",
            f"mixed GPU models: CUDA numbers them fastest first ({shown})",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        )
    return Check("cuda devices", "pass", shown or "no GPU visible")


def _no_rdma(f: Facts) -> Check:
    return Check(
        "rdma devices",
        "warn",
        f"no RDMA device ({f.sysfs_root}/class/infiniband is empty or absent): "
        "transfers between hosts use tcp",
        "none on a tcp-only node; else load the NIC driver (mlx5_ib) and install rdma-core",
    )


def active_mtu(netdev_mtu: int) -> int:
    """The RDMA MTU a RoCE port runs over a netdev of `netdev_mtu` bytes (as the kernel)."""
    room = netdev_mtu - ROCE_HEADERS_BYTES
    return max((m for m in IB_MTUS if m <= room), default=0)


def _rdma(f: Facts) -> list[Check]:
    checks = []
    for nic in f.topology.nics:
        checks.append(_nic(f, nic))
    if not f.has_pyverbs:
        checks.append(
            Check(
                "pyverbs",
                "fail",
                "pyverbs is not installed: rdma cannot be used",
                "apt install python3-pyverbs (or build rdma-core's pyverbs)",
            )
        )
    if not f.has_rdma_loop:
        checks.append(
            Check(
                "rdma c loop",
                "warn",
                "the RDMA C data loop (native/_rdmaloop.c) was not built: no libibverbs "
                "headers at install (transfer.rdma_data_loop = auto or c would use it)",
                "apt install libibverbs-dev (rdma-core's headers), then reinstall mooncake",
            )
        )
    return checks


def _nic(f: Facts, nic: NicInfo) -> Check:
    name = f"rdma {nic.name}"
    active = [p for p in nic.ports if p.is_active]
    if not active:
        states = ", ".join(f"port {p.port} {p.state}" for p in nic.ports) or "no port"
        others = [n.name for n in f.topology.nics if n.is_active]
        return Check(
            name,
            "warn" if others else "fail",  # NOTE: the others still carry transfers
            f"{states}: not used" + (f" ({', '.join(others)} are)" if others else ", no NIC is"),
            "bring the link up (cable, switch port; `ibstat`, `ip link`) or leave the "
            "NIC out with transfer.nics",
        )
    port = active[0]
    what = f"port {port.port} ACTIVE, {port.link_layer or '?'}, {port.rate_gbps:g} Gb/s"
    verbs_mtu = f.verbs_mtus.get((nic.name, port.port))
    if port.link_layer != "Ethernet":
        if verbs_mtu is None:
            return Check(name, "pass", f"{what}, active MTU unknown (pyverbs could not say)")
        if verbs_mtu < 4096:
            return Check(
                name,
                "warn",
                f"{what}, active MTU {verbs_mtu}",
                "set the subnet manager's MTU (OpenSM: mtu 4096 for its partition)",
            )
        return Check(name, "pass", f"{what}, active MTU {verbs_mtu}")
    gids = sysfs.read_gid_table(nic.name, port.port, f.sysfs_root)
    v2 = [g for g in gids if g.is_roce_v2_ipv4]
    netdev = nic.netdevs[0] if nic.netdevs else "its netdev"
    if not v2:
        return Check(
            name,
            "fail",
            f"{what}, no RoCE v2 GID with an IPv4 address (GIDs: {_gid_list(gids)})",
            f"give {netdev} an IPv4 address: RoCE v2 GIDs are made from them",
        )
    mtu = sysfs.read_netdev_mtu(netdev, f.sysfs_root) if nic.netdevs else None
    what += f", RoCE v2 GID index {v2[0].index}"
    if mtu is None and verbs_mtu is None:
        return Check(name, "warn", f"{what}, MTU unknown", f"check `ip link show {netdev}`")
    rdma_mtu = verbs_mtu if verbs_mtu is not None else active_mtu(mtu or 0)
    if rdma_mtu < 4096:
        return Check(
            name,
            "warn",
            f"{what}, active MTU {rdma_mtu} ({netdev} mtu {mtu or '?'})",
            f"ip link set {netdev} mtu 9000 (and jumbo frames on the switch ports)",
        )
    return Check(name, "pass", f"{what}, active MTU {rdma_mtu}")


def _gid_list(gids: Sequence[GidEntry]) -> str:
    return ", ".join(f"{g.index} {g.gid_type or 'type unknown'}" for g in gids) or "none"


def _gpu_registration(f: Facts) -> Check:
    name = "gpu memory registration"
    if not (f.topology.gpus and f.topology.nics):
        return Check(name, "skip", "needs a GPU and an RDMA device")
    if (f.sysfs_root / "module" / "nvidia_peermem").is_dir():
        return Check(name, "pass", "nvidia-peermem loaded: the NICs register GPU memory")
    version = _module_text(f, "nvidia", "version") or "0"
    driver = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if f.kernel >= DMABUF_KERNEL and driver >= DMABUF_DRIVER:
        return Check(
            name,
            "warn",
            f"nvidia-peermem not loaded; dma-buf registration will be "
            f"used (kernel {f.kernel[0]}.{f.kernel[1]}, driver {version})",
            "modprobe nvidia-peermem (the older, widely tested path)",
        )
    return Check(
        name,
        "fail",
        f"neither nvidia-peermem nor dma-buf (kernel {f.kernel[0]}."
        f"{f.kernel[1]}, driver {version}): GPU memory cannot be registered",
        "modprobe nvidia-peermem, or upgrade to kernel >= 5.12 and driver >= 515",
    )


def _memlock(f: Facts) -> Check:
    limit = f.memlock_bytes
    if limit is None:
        return Check("locked memory", "pass", "RLIMIT_MEMLOCK unlimited")
    shown = f"RLIMIT_MEMLOCK {limit >> 20} MiB"
    if not f.topology.nics:
        return Check("locked memory", "pass", f"{shown}; only RDMA registration pins memory")
    return Check(
        "locked memory",
        "fail",
        f"{shown}: RDMA cannot register the pool's memory",
        "ulimit -l unlimited (systemd: LimitMEMLOCK=infinity)",
    )


def _pairing(f: Facts) -> list[Check]:
    topo = f.topology
    if not (topo.gpus and topo.usable_nic_names):
        return [Check("gpu-nic pairing", "skip", "needs a GPU and a usable RDMA NIC")]
    nics = {n.name: n for n in topo.nics}
    checks = []
    for i, gpu in enumerate(cudamap.visible_gpus(topo.gpus, f.env)):
        pref = topo.nics_for(f"cuda:{gpu.index}").preferred
        if not pref:
            checks.append(
                Check(
                    f"gpu-nic cuda:{i}",
                    "fail",
                    f"GPU {gpu.index}: no usable NIC",
                    "bring a NIC's port up or widen transfer.nics",
                )
            )
            continue
        near = nics[pref[0]]
        hops = pci_distance(gpu.pci_path, near.pci_path)
        detail = f"GPU {gpu.index} -> {', '.join(pref)} ({hops} PCIe hops, NUMA {near.numa_node})"
        if gpu.numa_node is not None and near.numa_node not in (gpu.numa_node, None):
            checks.append(
                Check(
                    f"gpu-nic cuda:{i}",
                    "warn",
                    f"{detail}: across sockets",
                    "put a NIC on this GPU's socket, or accept the slower path",
                )
            )
        else:
            checks.append(Check(f"gpu-nic cuda:{i}", "pass", detail))
    return checks


def summary(checks: Sequence[Check]) -> dict[str, int]:
    """How many checks ended in each status."""
    counts = {"pass": 0, "warn": 0, "fail": 0, "skip": 0}
    for c in checks:
        counts[c.status] += 1
    return counts
