"""`mooncake doctor` on recorded machines (sysfs trees from tests/fixtures/topology, a fake
NVML): a ready DGX H100, and each way a node fails; its config checks against real files,
ports and a real master; the --json shape and exit status."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from mooncake.config.load import load_config
from mooncake.hw.doctor import Check, Facts, active_mtu, check_node, gather
from mooncake.hw.doctorconfig import check_config
from mooncake.hw.topology import detect_topology
from mooncake.native.verbs_info import read_active_mtus
from tests.fakes.nvml import NVML_ERROR_LIBRARY_NOT_FOUND as NVML_LIB_NOT_FOUND
from tests.fakes.nvml import FakeNvml
from tests.fakes.sysfs import build_sysfs, load_machine, with_changes
from tests.store.cluster import SECRET, start_master

ROCE_V2 = "0000:0000:0000:0000:0000:ffff:0a00:0007"  # 10.0.0.7 as a RoCE v2 GID


def _facts(
    machine: dict[str, Any],
    tmp: Path,
    *,
    modules: dict[str, str] | None = None,
    nic_allow: list[str] | None = None,
    **kw: Any,
) -> Facts:
    root = build_sysfs(machine, tmp / "sys")
    for module, version in (modules or {}).items():  # /sys/module/<name>[/version]
        (root / "module" / module).mkdir(parents=True, exist_ok=True)
        if version:
            (root / "module" / module / "version").write_text(version + "\n")
    topo = detect_topology(root, nvml=FakeNvml(machine["gpus"]), nic_allow=nic_allow)
    values: dict[str, Any] = {
        "env": {},
        "memlock_bytes": None,
        "kernel": (6, 5),
        "has_pyverbs": True,
    }
    values.update(kw)
    return Facts(topology=topo, sysfs_root=root, **values)


READY = {"nvidia": "550.54.15", "nvidia_peermem": ""}


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_ready_dgx_h100_passes_every_check(tmp_path: Path) -> None:
    checks = check_node(_facts(load_machine("dgx_h100"), tmp_path, modules=READY))
    assert [c for c in checks if c.status != "pass"] == []
    found = _by_name(checks)
    assert "8 GPUs" in found["nvidia driver"].detail
    assert "active MTU unknown" in found["rdma mlx5_0"].detail  # no pyverbs answer given
    assert found["gpu-nic cuda:5"].detail.startswith("GPU 5 -> mlx5_5")
    assert len([c for c in checks if c.name.startswith("rdma mlx5_")]) == 8


def _roce(gid_types: dict[str, str], gids: dict[str, str], mtu: int) -> dict[str, Any]:
    port = "infiniband/mlx5_0/ports/1"
    return with_changes(
        load_machine("workstation"),
        {
            f"{port}/gids": gids,
            f"{port}/gid_types": gid_types,
            "infiniband/mlx5_0/mtu": mtu,
        },
    )


def test_roce_port_needs_an_ipv4_roce_v2_gid_and_jumbo_frames(tmp_path: Path) -> None:
    link_local = "fe80:0000:0000:0000:ba3f:d2ff:fe47:1c52"
    good = _roce(
        {"0": "IB/RoCE v1", "1": "RoCE v2", "2": "IB/RoCE v1", "3": "RoCE v2"},
        {"0": link_local, "1": link_local, "2": ROCE_V2, "3": ROCE_V2},
        9000,
    )
    nic = _by_name(check_node(_facts(good, tmp_path / "a", modules=READY)))["rdma mlx5_0"]
    assert (nic.status, nic.fix) == ("pass", "")
    assert "RoCE v2 GID index 3" in nic.detail and "active MTU 4096" in nic.detail

    v1_only = _roce({"0": "IB/RoCE v1", "1": "RoCE v2"}, {"0": link_local, "1": link_local}, 9000)
    nic = _by_name(check_node(_facts(v1_only, tmp_path / "b")))["rdma mlx5_0"]
    assert nic.status == "fail" and "enp2s0f0np0 an IPv4 address" in nic.fix

    small = _roce({"3": "RoCE v2"}, {"3": ROCE_V2}, 1500)
    nic = _by_name(check_node(_facts(small, tmp_path / "c")))["rdma mlx5_0"]
    assert nic.status == "warn" and "active MTU 1024" in nic.detail
    assert nic.fix.startswith("ip link set enp2s0f0np0 mtu 9000")
    assert [active_mtu(m) for m in (1500, 4200, 9000)] == [1024, 4096, 4096]


def test_down_port_memlock_and_missing_pyverbs_fail(tmp_path: Path) -> None:
    facts = _facts(
        load_machine("workstation:nic_down"), tmp_path, memlock_bytes=8 << 20, has_pyverbs=False
    )
    found = _by_name(check_node(facts))
    assert found["rdma mlx5_0"].status == "fail" and "DOWN" in found["rdma mlx5_0"].detail
    assert found["locked memory"].status == "fail" and "ulimit -l" in found["locked memory"].fix
    assert found["pyverbs"].status == "fail"


def test_a_node_with_nics_warns_when_the_rdma_c_loop_was_not_built(tmp_path: Path) -> None:
    found = _by_name(check_node(_facts(load_machine("dgx_h100"), tmp_path, has_rdma_loop=False)))
    assert found["rdma c loop"].status == "warn" and "libibverbs-dev" in found["rdma c loop"].fix
    built = _by_name(check_node(_facts(load_machine("dgx_h100"), tmp_path / "b")))
    assert "rdma c loop" not in built


def test_infiniband_active_mtu_from_pyverbs(tmp_path: Path) -> None:
    mtus = {(f"mlx5_{i}", 1): 4096 for i in range(8)} | {("mlx5_2", 1): 2048}
    found = _by_name(
        check_node(_facts(load_machine("dgx_h100"), tmp_path, modules=READY, verbs_mtus=mtus))
    )
    assert (
        found["rdma mlx5_0"].status == "pass" and "active MTU 4096" in found["rdma mlx5_0"].detail
    )
    assert found["rdma mlx5_2"].status == "warn" and "subnet manager" in found["rdma mlx5_2"].fix


class _FakeVerbsDevice:
    """pyverbs.device's Context for ports whose ibv_query_port answers (enum ibv_mtu)."""

    def __init__(self, mtus: dict[str, int]):
        self.mtus, self.closed = mtus, 0

    def Context(self, name: str) -> Any:  # noqa: N802 - pyverbs' name
        if name not in self.mtus:
            raise OSError(f"Failed to open device {name}")  # as PyverbsRDMAError would
        outer, enum = self, self.mtus[name]

        class _Ctx:
            def query_port(self, port: int) -> Any:
                return SimpleNamespace(active_mtu=enum)

            def close(self) -> None:
                outer.closed += 1

        return _Ctx()


def test_active_mtus_read_through_pyverbs() -> None:
    fake = _FakeVerbsDevice({"mlx5_0": 5, "mlx5_1": 3})
    got = read_active_mtus([("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_9", 1)], fake)
    assert got == {("mlx5_0", 1): 4096, ("mlx5_1", 1): 1024}  # mlx5_9 cannot be opened
    assert fake.closed == 2


def test_one_down_nic_among_active_ones_warns(tmp_path: Path) -> None:
    h100 = with_changes(load_machine("dgx_h100"), {"infiniband/mlx5_3/ports/1/state": "1: DOWN"})
    found = _by_name(check_node(_facts(h100, tmp_path, modules=READY)))
    assert found["rdma mlx5_3"].status == "warn" and "DOWN: not used" in found["rdma mlx5_3"].detail
    assert found["gpu-nic cuda:3"].status == "pass"  # its GPU falls back to another NIC


def test_gpu_registration_peermem_dmabuf_or_neither(tmp_path: Path) -> None:
    h100 = load_machine("dgx_h100")
    dmabuf = _facts(h100, tmp_path / "a", modules={"nvidia": "550.54.15"})
    check = _by_name(check_node(dmabuf))["gpu memory registration"]
    assert check.status == "warn" and "dma-buf" in check.detail
    old = _facts(h100, tmp_path / "b", modules={"nvidia": "470.82.01"}, kernel=(5, 4))
    check = _by_name(check_node(old))["gpu memory registration"]
    assert check.status == "fail" and "nvidia-peermem" in check.fix


def test_cuda_visible_devices_checked_against_nvml(tmp_path: Path) -> None:
    h100 = load_machine("dgx_h100")
    bad = _by_name(
        check_node(_facts(h100, tmp_path / "a", modules=READY, env={"CUDA_VISIBLE_DEVICES": "4,9"}))
    )
    assert bad["cuda devices"].status == "fail" and "'9' names no GPU" in bad["cuda devices"].detail
    uuids = [g["uuid"] for g in sorted(h100["gpus"], key=lambda g: g["pci"])]
    good = _by_name(
        check_node(
            _facts(h100, tmp_path / "b", modules=READY, env={"CUDA_VISIBLE_DEVICES": uuids[6]})
        )
    )
    assert good["cuda devices"].status == "pass"
    assert good["cuda devices"].detail.startswith("cuda:0 = GPU 6")
    assert list(good) == [*list(good)[:-1], "gpu-nic cuda:0"]  # only the visible GPU paired
    order = _by_name(
        check_node(_facts(h100, tmp_path / "c", modules=READY, torch_uuids=[uuids[1], uuids[0]]))
    )
    assert order["cuda devices"].status == "warn"
    assert order["cuda devices"].fix == "export CUDA_DEVICE_ORDER=PCI_BUS_ID"


def test_gpu_whose_only_nic_is_on_the_other_socket_warns(tmp_path: Path) -> None:
    found = _by_name(
        check_node(_facts(load_machine("dgx_h100"), tmp_path, modules=READY, nic_allow=["mlx5_0"]))
    )
    assert found["gpu-nic cuda:0"].status == "pass"
    assert (
        found["gpu-nic cuda:5"].status == "warn"
        and "across sockets" in found["gpu-nic cuda:5"].detail
    )


@pytest.mark.parametrize("how", ["package", "init"])
def test_a_gpu_torch_sees_but_nvml_does_not_fails_with_the_fix(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch sees the GPUs, NVML reports none (nvidia-ml-py missing, or NVML's library not
    loading): the node would run blind to the GPU's placement, so the check fails."""
    from mooncake.native import nvml

    machine = load_machine("dgx_h100")
    root = build_sysfs(machine, tmp_path / "sys")
    if how == "package":
        monkeypatch.setattr(nvml, "load_pynvml", lambda: None)
        topo = detect_topology(root)
    else:
        topo = detect_topology(root, nvml=FakeNvml(machine["gpus"], init_error=NVML_LIB_NOT_FOUND))
    uuids = [g["uuid"] for g in machine["gpus"]]
    facts = Facts(topology=topo, sysfs_root=root, env={}, memlock_bytes=None, torch_uuids=uuids)
    check = _by_name(check_node(facts))["nvidia driver"]
    assert check.status == "fail"
    assert check.detail.startswith("torch sees 8 CUDA devices but no NVIDIA GPU found")
    if how == "package":
        assert check.fix == "pip install nvidia-ml-py"
    else:
        assert "NVML Shared Library Not Found" in check.detail
        assert "libnvidia-ml.so.1" in check.fix
    without_cuda = Facts(topology=topo, sysfs_root=root, env={}, memlock_bytes=None)
    assert _by_name(check_node(without_cuda))["nvidia driver"].status == "warn"  # a CPU node


def test_cli_fails_a_gpu_without_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mooncake doctor` on a host whose torch sees CUDA and whose NVML is missing: exit 1,
    the fix in the row."""
    from mooncake.native import cudamap, nvml

    load_verbs()
    monkeypatch.setattr(nvml, "load_pynvml", lambda: None)
    monkeypatch.setattr(cudamap, "torch_uuids", lambda: ["GPU-0a1b"])
    root = build_sysfs(load_machine("workstation"), tmp_path / "sys")
    result = CliRunner().invoke(app, ["doctor", "--json", "--sysfs-root", str(root)])
    found = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert found["nvidia driver"]["status"] == "fail"
    assert found["nvidia driver"]["fix"] == "pip install nvidia-ml-py"
    assert result.exit_code == 1


def test_this_machine_warns_for_no_gpu_and_no_rdma_and_fails_nothing() -> None:
    found = _by_name(check_node(gather()))
    assert found["nvidia driver"].status == "warn"
    assert found["rdma devices"].status == "warn"
    assert not [c for c in found.values() if c.status == "fail"]


def _config(tmp: Path, **overrides: object) -> Any:
    values = {
        "cluster.master": "127.0.0.1:1",
        "cluster.secret": SECRET,
        "metrics.port": 0,
        "api.port": 1,
        **overrides,
    }
    return load_config(None, env={}, overrides=values).config


def test_config_ssd_path_odirect_and_space(tmp_path: Path) -> None:
    ok = _by_name(
        check_config(
            _config(tmp_path, **{"store.ssd_bytes": "1MiB", "store.ssd_path": str(tmp_path)})
        )
    )
    assert ok["ssd tier"].status == "pass" and "O_DIRECT works" in ok["ssd tier"].detail
    assert os.listdir(tmp_path) == []  # the probe file is gone
    shm = check_config(
        _config(tmp_path, **{"store.ssd_bytes": "1MiB", "store.ssd_path": "/dev/shm"})
    )
    assert _by_name(shm)["ssd tier"].status == "fail"  # tmpfs: memory, not a disk
    huge = check_config(
        _config(tmp_path, **{"store.ssd_bytes": "1000TiB", "store.ssd_path": str(tmp_path)})
    )
    assert _by_name(huge)["ssd tier"].status == "fail"
    missing = check_config(
        _config(tmp_path, **{"store.ssd_bytes": "1MiB", "store.ssd_path": str(tmp_path / "new")})
    )
    assert _by_name(missing)["ssd tier"].status == "pass"  # created, as the node creates it
    assert (tmp_path / "new").is_dir()
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "ssd")
    under_file = check_config(
        _config(tmp_path, **{"store.ssd_bytes": "1MiB", "store.ssd_path": bad})
    )
    assert _by_name(under_file)["ssd tier"].status == "fail"
    assert f"cannot create {bad}" in _by_name(under_file)["ssd tier"].detail


def test_config_ports_taken(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        port = held.getsockname()[1]
        found = _by_name(
            check_config(
                _config(tmp_path, **{"node.port_range": f"{port}-{port}", "api.port": port})
            )
        )
    assert found["node ports"].status == "fail"
    assert found["api port"].status == "warn" and f":{port} is in use" in found["api port"].detail


@pytest.mark.cluster
def test_config_master_reached_and_secret_checked(tmp_path: Path) -> None:
    nothing = _by_name(check_config(_config(tmp_path)))["master"]
    assert nothing.status == "fail" and "start the master" in nothing.fix
    master = start_master()
    try:
        addr = master.address.removeprefix("tcp://")
        good = check_config(_config(tmp_path, **{"cluster.master": addr}))
        assert _by_name(good)["master"].status == "pass"
        wrong = _config(
            tmp_path, **{"cluster.master": addr, "cluster.secret": "another-secret-0123456789"}
        )
        bad = _by_name(check_config(wrong, master_timeout_s=1.0))["master"]
        assert bad.status == "fail" and "secret is refused" in bad.detail
    finally:
        master.stop()


def test_cli_json_shape_and_exit_status(tmp_path: Path) -> None:
    load_verbs()
    root = build_sysfs(load_machine("workstation:nic_down"), tmp_path / "sys")
    result = CliRunner().invoke(app, ["doctor", "--json", "--sysfs-root", str(root)])
    out = json.loads(result.output)
    assert set(out) == {"checks", "summary", "ok"}
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in out["checks"])
    assert {c["status"] for c in out["checks"]} <= {"pass", "warn", "fail", "skip"}
    assert out["summary"]["fail"] == sum(c["status"] == "fail" for c in out["checks"]) > 0
    assert (out["ok"], result.exit_code) == (False, 1)
    here = CliRunner().invoke(app, ["doctor", "--json"])
    assert (json.loads(here.output)["ok"], here.exit_code) == (True, 0)
