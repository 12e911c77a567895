"""`mooncake topo`: show the hardware this node detected and the NIC each location prefers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mooncake.cli.app import app
from mooncake.cli.output import sysfs_root_option

if TYPE_CHECKING:
    from mooncake.hw.topology import Topology


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def _cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's cpulist form)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _numa(node: int | None) -> str:
    return "?" if node is None else str(node)


def _render(topo: Topology) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.tree import Tree

    from mooncake.cli.output import console

    tree = Tree(
        f"[bold]{topo.hostname}[/]: {topo.cpu_count} CPUs, memory "
        f"{_gib(topo.memory_available_bytes)} available of {_gib(topo.memory_total_bytes)}"
    )
    numa = tree.add(f"NUMA nodes: {len(topo.numa_nodes)}")
    for n in topo.numa_nodes:
        numa.add(
            f"node {n.id}: CPUs {_cpus(n.cpus)}; memory {_gib(n.memory_free_bytes)} free "
            f"of {_gib(n.memory_total_bytes)}"
        )
    gpus = tree.add(f"GPUs: {len(topo.gpus) or 'none (no NVIDIA GPU found)'}")
    for g in topo.gpus:
        gpus.add(
            f"cuda:{g.index} {g.name} {g.pci_bus_id} NUMA {_numa(g.numa_node)}: "
            f"{_gib(g.memory_free_bytes)} free of {_gib(g.memory_total_bytes)}"
        )
    nics = tree.add(f"RDMA NICs: {len(topo.nics) or 'none (no RDMA NIC found)'}")
    for nic in topo.nics:
        ports = "; ".join(
            f"port {p.port} {p.state} {p.rate_gbps:g} Gb/s {p.link_layer}" for p in nic.ports
        )
        line = (
            f"{nic.name} {nic.pci_bus_id or 'virtual'} NUMA {_numa(nic.numa_node)} "
            f"{','.join(nic.netdevs)}: {ports or 'no ports'}"
        )
        nics.add(escape(line) if nic.is_active else f"[dim]{escape(line)} (not used)[/]")
    console.print(tree)

    table = Table(title="Network interfaces", title_justify="left")
    for col in ("name", "up", "speed", "MTU", "addresses"):
        table.add_column(col)
    for i in topo.net_interfaces:
        speed = f"{i.speed_mbps} Mb/s" if i.speed_mbps else "?"
        table.add_row(i.name, "yes" if i.is_up else "no", speed, str(i.mtu), " ".join(i.addresses))
    console.print(table)

    table = Table(title="Disks and filesystems", title_justify="left")
    for col in ("name", "kind", "size", "free", "model / type"):
        table.add_column(col)
    for d in topo.disks:
        kind = "HDD" if d.is_rotational else "SSD"
        table.add_row(d.name, kind, _gib(d.size_bytes), "", d.model)
    for f in topo.filesystems:
        kind = {True: "on HDD", False: "on SSD", None: ""}[f.is_rotational]
        table.add_row(f.mountpoint, kind, _gib(f.total_bytes), _gib(f.free_bytes), f.fstype)
    console.print(table)

    table = Table(title="NIC preference", title_justify="left")
    for col in ("location", "preferred", "available"):
        table.add_column(col)
    for location, pref in topo.nic_preference.items():
        table.add_row(location, " ".join(pref.preferred) or "-", " ".join(pref.available) or "-")
    console.print(table)

    if topo.notes:
        console.print("[bold]Notes[/]")
        for note in topo.notes:
            console.print(f"  - {note}", highlight=False)


@app.command(
    "topo",
    help="Show what this node detected: NUMA nodes, GPUs (NVML), RDMA NICs (sysfs, pyverbs), "
    "network interfaces, disks and filesystems, and the RDMA NICs each location prefers.\n\n"
    'Locations are "cpu:N" (NUMA node N) and "cuda:N" (GPU N in PCI bus order, as with '
    "CUDA_DEVICE_ORDER=PCI_BUS_ID). A GPU prefers the NICs nearest on the PCIe tree among "
    "those on its NUMA node; a NUMA node prefers its own NICs. Only NICs with an ACTIVE port "
    "are used. Missing hardware is reported in the notes, never an error; exits 0.",
)
def topo(
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the whole topology as JSON (keys hostname, cpu_count, memory_total_bytes, "
        "memory_available_bytes, numa_nodes, gpus, nics, net_interfaces, disks, filesystems, "
        "nic_preference, notes).",
    ),
    nics: str = typer.Option(
        "",
        "--nics",
        metavar="NAME,NAME",
        help="Only these RDMA NICs may carry transfers (comma-separated, e.g. mlx5_0,mlx5_1), "
        "as transfer.nics in the config; empty = every detected NIC.",
    ),
    sysfs_root: Path = sysfs_root_option("NVML, pyverbs and psutil facts"),
) -> None:
    """Detect and print this node's topology."""
    from mooncake.cli.output import print_json
    from mooncake.hw.topology import detect_topology

    allow = [name.strip() for name in nics.split(",") if name.strip()]
    topology = detect_topology(sysfs_root=sysfs_root, nic_allow=allow or None)
    if as_json:
        print_json(topology)
    else:
        _render(topology)
