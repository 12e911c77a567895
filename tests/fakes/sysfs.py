"""Expand a recorded machine description (tests/fixtures/topology/*.json) into a sysfs tree.

The tree has the real layout: device directories under devices/pci<domain>:<bus>/... with
relative symlinks from bus/pci/devices, class/infiniband, class/net, class/block and block,
as the kernel makes them, so the readers resolve paths exactly as on a server.

Machine description keys: numa_nodes, pci_devices (bus id -> full path from the root
complex, numa_node, class, vendor, device, driver), infiniband (name -> pci, node_guid,
netdevs, optional netdev mtu, ports with optional gid_types), block (name -> dir under
devices/, device link, model, size, partitions), gpus (what the fake NVML reports) and
variants (name -> {"a/b/c": value} overrides).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def load_machine(name: str) -> dict[str, Any]:
    """The description `name` ("dgx_a100") or a variant of it ("workstation:nic_down")."""
    base, _, variant = name.partition(":")
    machine = json.loads((FIXTURES / f"{base}.json").read_text())
    for key, value in (machine.get("variants", {}).get(variant, {}) if variant else {}).items():
        set_key(machine, key, value)
    return machine


def set_key(machine: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """Set machine["a"]["b"]["c"] = value for key "a/b/c" (bus ids contain dots)."""
    *parents, last = key.split("/")
    node = machine
    for part in parents:
        node = node[part]
    node[last] = value
    return machine


def with_changes(machine: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `machine` with "a/b/c" keys overridden."""
    result = copy.deepcopy(machine)
    for key, value in changes.items():
        set_key(result, key, value)
    return result


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs has them."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(os.path.relpath(target, link.parent))


def _build_pci(root: Path, bus_id: str, dev: dict[str, Any]) -> None:
    parts = dev["path"].split("/")
    assert parts[-1] == bus_id, (bus_id, dev["path"])
    for depth in range(1, len(parts)):  # every bridge on the way, then the device itself
        d = root / "devices" / "/".join(parts[: depth + 1])
        d.mkdir(parents=True, exist_ok=True)
        is_device = depth == len(parts) - 1
        if is_device or not (d / "numa_node").exists():
            _write(d / "numa_node", str(dev["numa_node"]))
            _write(d / "class", dev["class"] if is_device else "0x060400")  # PCI bridge
            _write(d / "vendor", dev["vendor"] if is_device else "0x1000")
        _link(root / "bus" / "pci" / "devices" / parts[depth], d)
    device_dir = root / "devices" / dev["path"]
    _write(device_dir / "device", dev["device"])
    _link(device_dir / "driver", root / "bus" / "pci" / "drivers" / dev["driver"])
    (root / "bus" / "pci" / "drivers" / dev["driver"]).mkdir(parents=True, exist_ok=True)


def _build_ib(root: Path, name: str, nic: dict[str, Any], machine: dict[str, Any]) -> None:
    if nic["pci"] is None:  # software RDMA (rxe, siw): no PCI function, no device link
        dev_dir = root / "devices" / "virtual" / "infiniband" / name
    else:
        pci_dir = root / "devices" / machine["pci_devices"][nic["pci"]]["path"]
        dev_dir = pci_dir / "infiniband" / name
        dev_dir.mkdir(parents=True, exist_ok=True)
        (dev_dir / "device").symlink_to(f"../../../{nic['pci']}")  # as the kernel writes it
        for netdev in nic["netdevs"]:
            _write(pci_dir / "net" / netdev / "operstate", "up")
            if "mtu" in nic:
                _write(pci_dir / "net" / netdev / "mtu", str(nic["mtu"]))
            _link(root / "class" / "net" / netdev, pci_dir / "net" / netdev)
    _write(dev_dir / "node_guid", nic["node_guid"])
    _write(dev_dir / "node_type", "1: CA")
    for port, attrs in nic["ports"].items():
        port_dir = dev_dir / "ports" / port
        for attr in ("state", "phys_state", "rate", "link_layer"):
            _write(port_dir / attr, attrs[attr])
        for index, gid in attrs["gids"].items():
            _write(port_dir / "gids" / index, gid)
        for index, kind in attrs.get("gid_types", {}).items():  # RoCE: per-GID types
            _write(port_dir / "gid_attrs" / "types" / index, kind)
    _link(root / "class" / "infiniband" / name, dev_dir)


def _build_block(root: Path, name: str, blk: dict[str, Any]) -> None:
    dev_dir = root / "devices" / blk["dir"]
    _write(dev_dir / "size", str(blk["size_sectors"]))
    _write(dev_dir / "removable", str(blk["removable"]))
    _write(dev_dir / "queue" / "rotational", str(blk["rotational"]))
    if "device" in blk:
        target = (dev_dir / blk["device"]).resolve()
        _write(target / "model", blk["model"])
        _link(dev_dir / "device", target)
    _link(root / "block" / name, dev_dir)
    _link(root / "class" / "block" / name, dev_dir)
    for index, (part, sectors) in enumerate(blk.get("partitions", []), start=1):
        _write(dev_dir / part / "partition", str(index))
        _write(dev_dir / part / "size", str(sectors))
        _link(root / "class" / "block" / part, dev_dir / part)


def build_sysfs(machine: dict[str, Any], root: Path) -> Path:
    """Write `machine` as a sysfs tree under `root` (created) and return `root`."""
    root.mkdir(parents=True, exist_ok=True)
    node_dir = root / "devices" / "system" / "node"
    for node_id, node in machine["numa_nodes"].items():
        d = node_dir / f"node{node_id}"
        _write(d / "cpulist", node["cpulist"])
        used_kb = node["mem_total_kb"] - node["mem_free_kb"]
        _write(
            d / "meminfo",
            f"Node {node_id} MemTotal:       {node['mem_total_kb']} kB\n"
            f"Node {node_id} MemFree:        {node['mem_free_kb']} kB\n"
            f"Node {node_id} MemUsed:        {used_kb} kB",
        )
    _write(node_dir / "online", ",".join(machine["numa_nodes"]))
    for bus_id, dev in machine["pci_devices"].items():
        _build_pci(root, bus_id, dev)
    for name, nic in machine["infiniband"].items():
        _build_ib(root, name, nic, machine)
    for name, blk in machine["block"].items():
        _build_block(root, name, blk)
    return root
