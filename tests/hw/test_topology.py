"""Topology detection over recorded sysfs trees (DGX A100-like, DGX H100-like, workstation)
with a fake NVML, and on this real machine (no GPU, no RDMA NIC)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from mooncake.hw.topology import (
    NicPreference,
    Topology,
    compute_nic_preference,
    detect_topology,
    pci_distance,
)
from mooncake.native import nvml as nvml_reader
from mooncake.native import sysfs, verbs_info
from tests.fakes.nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    FakeNvml,
    NVMLError,
    NVMLError_Uninitialized,
)
from tests.fakes.sysfs import build_sysfs, load_machine, with_changes

A100_ALL = [f"mlx5_{i}" for i in range(9)]  # 8 compute NICs + storage NIC mlx5_8


def detect(machine: dict[str, Any], tmp: Path, **kwargs: Any) -> Topology:
    root = build_sysfs(machine, tmp / "sys")
    return detect_topology(root, nvml=FakeNvml(machine["gpus"]), **kwargs)


@pytest.fixture(scope="module")
def a100(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    return detect(load_machine("dgx_a100"), tmp_path_factory.mktemp("a100"))


def others(*names: str) -> list[str]:
    return [n for n in A100_ALL if n not in names]


def test_a100_each_gpu_prefers_the_two_nics_behind_its_pcie_switch(a100: Topology) -> None:
    switch_nics = [
        ["mlx5_0", "mlx5_1"],
        ["mlx5_2", "mlx5_3"],
        ["mlx5_4", "mlx5_5"],
        ["mlx5_6", "mlx5_7"],
    ]
    for gpu in range(8):
        nics = switch_nics[gpu // 2]
        assert a100.nic_preference[f"cuda:{gpu}"] == NicPreference(nics, others(*nics)), gpu


def test_a100_numa_nodes_prefer_their_socket_nics(a100: Topology) -> None:
    assert list(a100.nic_preference) == ["cpu:0", "cpu:1"] + [f"cuda:{i}" for i in range(8)]
    socket0 = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_8"]
    socket1 = ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert a100.nic_preference["cpu:0"].preferred == socket0
    assert a100.nic_preference["cpu:0"].available == socket1
    assert a100.nic_preference["cpu:1"].preferred == socket1
    assert a100.nic_preference["cpu:1"].available == socket0


def test_a100_facts_read_from_sysfs_and_nvml(a100: Topology) -> None:
    assert [(n.id, len(n.cpus), n.cpus[:2], n.memory_total_bytes) for n in a100.numa_nodes] == [
        (0, 128, [0, 1], 528327160 * 1024),
        (1, 128, [64, 65], 528446592 * 1024),
    ]
    nic = a100.nics[0]
    assert (nic.name, nic.pci_bus_id, nic.numa_node, nic.netdevs) == (
        "mlx5_0",
        "0000:0c:00.0",
        0,
        ["ibp12s0"],
    )
    assert nic.pci_path == [
        "pci0000:00",
        "0000:00:01.1",
        "0000:01:00.0",
        "0000:02:08.0",
        "0000:0c:00.0",
    ]
    port = nic.ports[0]
    assert (port.port, port.state, port.is_active, port.rate_gbps, port.link_layer) == (
        1,
        "ACTIVE",
        True,
        200.0,
        "InfiniBand",
    )
    assert port.gid.startswith("fe80:0000:0000:0000:")
    assert a100.nics[8].ports[0].link_layer == "Ethernet"
    gpu = a100.gpus[7]
    assert (gpu.index, gpu.name, gpu.pci_bus_id, gpu.numa_node) == (
        7,
        "NVIDIA A100-SXM4-80GB",
        "0000:bd:00.0",
        1,
    )
    assert (gpu.memory_total_bytes, gpu.memory_free_bytes) == (85_899_345_920, 85_383_446_528)
    assert a100.notes == []


def test_a100_disks_skip_loop_and_ram_devices(a100: Topology) -> None:
    assert [(d.name, d.size_bytes, d.is_rotational, d.model) for d in a100.disks] == [
        ("nvme0n1", 3750748848 * 512, False, "SAMSUNG MZ1LB1T9HALS-00007"),
        ("nvme1n1", 7501476528 * 512, False, "SAMSUNG MZWLJ3T8HBLS-00007"),
        ("nvme2n1", 7501476528 * 512, False, "SAMSUNG MZWLJ3T8HBLS-00007"),
    ]


def test_allow_list_restricts_nics_and_names_unknown_ones(tmp_path: Path) -> None:
    allow = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_9"]
    topo = detect(load_machine("dgx_a100"), tmp_path, nic_allow=allow)
    assert topo.nic_preference["cpu:0"].preferred == ["mlx5_0", "mlx5_1"]
    assert topo.nic_preference["cpu:0"].available == ["mlx5_4"]
    assert topo.nic_preference["cuda:2"].preferred == ["mlx5_0", "mlx5_1"]  # its own NICs are out
    assert topo.nic_preference["cuda:6"].preferred == ["mlx5_4"]
    assert len(topo.nics) == 9  # nics lists every device; only the matrix obeys the allow-list
    assert any("mlx5_9: no such RDMA NIC" in n for n in topo.notes), topo.notes
    assert any("left out by the NIC allow-list: mlx5_2, mlx5_3, mlx5_5" in n for n in topo.notes)


def test_gpu_on_a_node_without_nics_prefers_the_nearest_nics_anywhere(tmp_path: Path) -> None:
    topo = detect(
        load_machine("dgx_a100"), tmp_path, nic_allow=["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    )
    assert topo.nic_preference["cuda:0"].preferred == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    assert topo.nic_preference["cpu:0"].preferred == []
    assert topo.nic_preference["cpu:0"].available == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]


def test_h100_each_gpu_prefers_its_one_nic(tmp_path: Path) -> None:
    topo = detect(load_machine("dgx_h100"), tmp_path)
    names = [f"mlx5_{i}" for i in range(8)]
    for gpu in range(8):
        pref = topo.nic_preference[f"cuda:{gpu}"]
        assert (pref.preferred, pref.available) == ([f"mlx5_{gpu}"], names[:gpu] + names[gpu + 1 :])
    assert topo.nic_preference["cpu:0"].preferred == names[:4]
    assert topo.nic_preference["cpu:1"].preferred == names[4:]
    assert [g.pci_bus_id for g in topo.gpus][:2] == ["0000:1b:00.0", "0000:3d:00.0"]


def test_workstation_numa_minus_one_means_the_only_node(tmp_path: Path) -> None:
    topo = detect(load_machine("workstation"), tmp_path)
    assert (topo.gpus[0].numa_node, topo.nics[0].numa_node) == (0, 0)
    assert topo.nic_preference["cuda:0"].preferred == ["mlx5_0"]
    assert topo.nic_preference["cpu:0"].preferred == ["mlx5_0"]
    assert [(d.name, d.is_rotational) for d in topo.disks] == [("nvme0n1", False), ("sda", True)]
    assert sysfs.disk_of("/dev/sda1", tmp_path / "sys") == "sda"
    assert sysfs.disk_of("/dev/nvme0n1p2", tmp_path / "sys") == "nvme0n1"


def test_numa_minus_one_on_two_nodes_stays_unknown_and_pcie_still_decides(tmp_path: Path) -> None:
    machine = with_changes(
        load_machine("dgx_a100"),
        {"pci_devices/0000:0c:00.0/numa_node": -1, "pci_devices/0000:07:00.0/numa_node": -1},
    )
    topo = detect(machine, tmp_path)
    assert topo.nics[0].numa_node is None and topo.gpus[0].numa_node is None
    assert "mlx5_0" not in topo.nic_preference["cpu:0"].preferred
    assert "mlx5_0" in topo.nic_preference["cpu:0"].available
    assert topo.nic_preference["cuda:0"].preferred == ["mlx5_0", "mlx5_1"]  # nearest over all
    assert topo.nic_preference["cuda:1"].preferred == [
        "mlx5_0",
        "mlx5_1",
    ]  # unknown stays a candidate
    assert "NUMA node unknown (sysfs numa_node -1) for GPU 0, mlx5_0" in topo.notes


def test_down_nic_is_listed_but_never_preferred(tmp_path: Path) -> None:
    topo = detect(load_machine("workstation:nic_down"), tmp_path)
    assert [(n.name, n.is_active, n.ports[0].state) for n in topo.nics] == [
        ("mlx5_0", False, "DOWN")
    ]
    assert all(p.preferred == [] and p.available == [] for p in topo.nic_preference.values())
    assert "mlx5_0 is not used: no ACTIVE port (port 1: DOWN)" in topo.notes
    assert topo.usable_nic_names == []
    assert topo.nics_for("cuda:9") == NicPreference([], [])  # unknown location: any usable NIC


def test_software_rdma_device_without_pci_is_a_usable_nic(tmp_path: Path) -> None:
    gid = "fe80:0000:0000:0000:0000:00ff:fe00:0001"
    port = {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "100 Gb/sec (4X EDR)",
        "link_layer": "Ethernet",
        "gids": {"0": gid},
    }
    rxe: dict[str, Any] = {
        "pci": None,
        "node_guid": "0000:00ff:fe00:0001",
        "netdevs": [],
        "ports": {"1": port},
    }
    machine = with_changes(load_machine("workstation:nic_down"), {"infiniband/rxe0": rxe})
    topo = detect(machine, tmp_path)
    soft = topo.nics[1]
    assert (soft.name, soft.pci_bus_id, soft.pci_path, soft.numa_node) == ("rxe0", "", [], 0)
    assert topo.nic_preference["cpu:0"] == NicPreference(["rxe0"], [])
    assert topo.nic_preference["cuda:0"] == NicPreference(["rxe0"], [])  # no PCIe distance known


def test_pci_distance_counts_hops_to_the_common_ancestor() -> None:
    gpu = ["pci0000:00", "0000:00:01.1", "0000:01:00.0", "0000:02:04.0", "0000:07:00.0"]
    same_switch = ["pci0000:00", "0000:00:01.1", "0000:01:00.0", "0000:02:08.0", "0000:0c:00.0"]
    other_rc = ["pci0000:60", "0000:60:03.1", "0000:61:00.0"]
    assert pci_distance(gpu, gpu) == 0
    assert pci_distance(gpu, same_switch) == 4
    assert pci_distance(gpu, other_rc) == 8
    assert pci_distance(gpu, []) is None
    assert compute_nic_preference([0], [], []) == {"cpu:0": NicPreference([], [])}
    names = ["mlx5_10", "mlx5_2", "mlx5_1"]
    assert sorted(names, key=sysfs.natural_key) == ["mlx5_1", "mlx5_2", "mlx5_10"]


def test_nvml_absent_gives_no_gpu_and_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    root = build_sysfs(load_machine("workstation"), tmp_path / "sys")
    topo = detect_topology(root)
    assert topo.gpus == []
    assert "no NVIDIA GPU found (pynvml not installed: pip install nvidia-ml-py)" in topo.notes
    assert topo.nic_preference["cpu:0"].preferred == ["mlx5_0"]


def test_nvml_driver_not_loaded_is_a_note() -> None:
    gpus, notes = nvml_reader.read_gpus(FakeNvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    assert (gpus, notes) == ([], ["no NVIDIA GPU found (NVML could not start: Driver Not Loaded)"])


def test_nvml_session_is_balanced_and_legacy_bytes_are_decoded(tmp_path: Path) -> None:
    machine = load_machine("workstation")
    root = build_sysfs(machine, tmp_path / "sys")
    fake = FakeNvml(machine["gpus"], legacy_bytes=True)
    with pytest.raises(NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()  # real NVML semantics: nothing works before nvmlInit
    gpus, notes = nvml_reader.read_gpus(fake, root)
    assert fake.init_count == 0 and fake.calls[-1] == "nvmlShutdown"
    assert (gpus[0].name, gpus[0].pci_bus_id, notes) == ("NVIDIA RTX A6000", "0000:01:00.0", [])
    assert (
        isinstance(NVMLError(1), NVMLError_Uninitialized) and str(NVMLError(1)) == "Uninitialized"
    )
    assert nvml_reader.normalize_bus_id(b"00000000:B7:00.0") == "0000:b7:00.0"


def test_a_lost_gpu_is_left_out_with_a_note(tmp_path: Path) -> None:
    machine = load_machine("dgx_h100")
    root = build_sysfs(machine, tmp_path / "sys")
    gpus, notes = nvml_reader.read_gpus(FakeNvml(machine["gpus"], lost=frozenset({3})), root)
    assert [g.index for g in gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert notes == ["GPU 3 left out: NVML error: GPU is lost"]


class PyverbsRDMAError(Exception):
    """Stands for pyverbs.pyverbs_error.PyverbsRDMAError."""


def _raise_no_devices() -> list[Any]:
    raise PyverbsRDMAError("Failed to get devices list")


def test_pyverbs_absent_or_without_devices_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pyverbs() -> Any:
        raise ImportError("No module named 'pyverbs'")

    monkeypatch.setattr("mooncake.native.rdma.load_pyverbs", no_pyverbs)
    assert verbs_info.read_verbs_devices() == verbs_info.VerbsInfo(
        False, [], "pyverbs not installed"
    )
    info = verbs_info.read_verbs_devices(SimpleNamespace(get_device_list=_raise_no_devices))
    assert (info.is_installed, info.device_names) == (True, [])
    assert info.reason.startswith("no RDMA devices")
    devices = [SimpleNamespace(name=b"mlx5_1"), SimpleNamespace(name=b"mlx5_0")]
    listed = verbs_info.read_verbs_devices(SimpleNamespace(get_device_list=lambda: devices))
    assert listed.device_names == ["mlx5_0", "mlx5_1"]


def test_nic_unseen_by_libibverbs_gets_a_note(tmp_path: Path) -> None:
    verbs = SimpleNamespace(get_device_list=_raise_no_devices)
    topo = detect(load_machine("workstation"), tmp_path, verbs=verbs)
    assert any(n.startswith("libibverbs does not list mlx5_0 (no RDMA devices") for n in topo.notes)


@pytest.mark.skipif(Path("/sys/class/infiniband").exists(), reason="this machine has RDMA devices")
def test_this_machine_reports_no_gpu_and_no_rdma_nic() -> None:
    topo = detect_topology()
    assert topo.gpus == [] and topo.nics == []
    assert any(n.startswith("no NVIDIA GPU found") for n in topo.notes), topo.notes
    assert "no RDMA NIC found (/sys/class/infiniband absent)" in topo.notes
    assert topo.memory_total_bytes > 0 and topo.numa_nodes and topo.net_interfaces
    assert msgspec.json.decode(msgspec.json.encode(topo), type=Topology) == topo


def _cli(*args: str) -> Any:
    from mooncake.cli.app import app, load_verbs

    load_verbs()
    return CliRunner().invoke(app, ["topo", *args])


@pytest.mark.skipif(Path("/sys/class/infiniband").exists(), reason="this machine has RDMA devices")
def test_cli_says_plainly_there_is_no_gpu_and_no_rdma_nic() -> None:
    result = _cli()
    assert result.exit_code == 0, result.output
    assert "GPUs: none (no NVIDIA GPU found)" in result.output
    assert "RDMA NICs: none (no RDMA NIC found)" in result.output


def test_cli_json_over_a_recorded_tree_with_an_allow_list(tmp_path: Path) -> None:
    root = build_sysfs(load_machine("dgx_a100"), tmp_path / "sys")
    result = _cli("--json", "--sysfs-root", str(root), "--nics", "mlx5_0,mlx5_4")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"gpus", "nics", "numa_nodes", "nic_preference", "notes"} <= set(data)
    assert data["nic_preference"]["cpu:0"] == {"preferred": ["mlx5_0"], "available": ["mlx5_4"]}
    assert len(data["nics"]) == 9


def test_a_nics_numa_cpus_come_from_its_pci_function_and_the_nodes_cpulist(
    tmp_path: Path,
) -> None:
    """What the RDMA C loop pins a NIC's poller to: the CPUs of the node its PCI function
    sits on; nothing for a device sysfs does not place (or does not have)."""
    from mooncake.native.sysfs import nic_numa_cpus, parse_cpulist

    machine = load_machine("dgx_h100")
    root = build_sysfs(machine, tmp_path / "sys")
    assert nic_numa_cpus("mlx5_0", root) == parse_cpulist("0-55,112-167")
    assert nic_numa_cpus("mlx5_7", root) == parse_cpulist("56-111,168-223")
    assert nic_numa_cpus("mlx5_99", root) == []
    pci = machine["infiniband"]["mlx5_0"]["pci"]
    unplaced = build_sysfs(
        with_changes(machine, {f"pci_devices/{pci}/numa_node": -1}), tmp_path / "sys2"
    )
    assert nic_numa_cpus("mlx5_0", unplaced) == []
