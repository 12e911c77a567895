"""torch's cuda:N mapped to NVML's GPUs under CUDA_VISIBLE_DEVICES (indices, UUIDs), and
what hangs on it: the NIC preference the node's Transfer Engines get; and a GPU that torch
sees but NVML does not is still used, with an error. A recorded DGX H100 (GPU i sits beside
NIC mlx5_i) with a fake NVML."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake.config.load import load_config
from mooncake.hw.topology import Topology, detect_topology
from mooncake.roles.node.common import NodeContext
from mooncake.roles.node.worker import connect_pool, mount_local_tiers
from tests.fakes.nvml import NVML_ERROR_LIBRARY_NOT_FOUND as NVML_LIB_NOT_FOUND
from tests.fakes.nvml import FakeNvml
from tests.fakes.sysfs import build_sysfs, load_machine
from tests.store.cluster import SECRET, start_master

GIB = 1 << 30


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    machine = load_machine("dgx_h100")
    for i, gpu in enumerate(machine["gpus"]):  # free memory tells the GPUs apart
        gpu["memory_free_bytes"] = (10 + i) * GIB
    root = build_sysfs(machine, tmp_path_factory.mktemp("h100") / "sys")
    return detect_topology(root, nvml=FakeNvml(machine["gpus"]))


def _indices(h100: Topology, value: str | None, **kw: Any) -> list[int]:
    from mooncake.native.cudamap import visible_gpus

    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    return [g.index for g in visible_gpus(h100.gpus, env, **kw)]


def test_visible_devices_by_index_and_by_uuid(h100: Topology) -> None:
    uuids = [g.uuid for g in h100.gpus]
    assert _indices(h100, None) == list(range(8))
    assert _indices(h100, "5,2") == [5, 2]
    assert _indices(h100, f"{uuids[6]},{uuids[1]}") == [6, 1]
    assert _indices(h100, uuids[3][:12]) == [3]  # a unique prefix, as CUDA accepts
    assert _indices(h100, uuids[3][4:]) == [3]  # without the GPU- prefix
    assert _indices(h100, "4,9,1") == [4]  # CUDA stops at the first invalid entry
    assert _indices(h100, "") == []
    assert _indices(h100, "GPU-") == []  # ambiguous: names every GPU, so none
    # torch's own UUIDs (CUDA initialised) decide over the variable
    assert _indices(h100, "0", torch_uuids=[uuids[7][4:], uuids[0]]) == [7, 0]


def test_nic_preference_keyed_by_torch_index(h100: Topology) -> None:
    """Under CUDA_VISIBLE_DEVICES=5,2 torch's cuda:0 is GPU 5: its preferred NIC is
    mlx5_5 (NVML's cuda:0 would give mlx5_0, a NIC behind another switch)."""
    from mooncake.native.cudamap import torch_keyed, visible_gpus

    keyed = torch_keyed(
        h100.nic_preference, visible_gpus(h100.gpus, {"CUDA_VISIBLE_DEVICES": "5,2"})
    )
    assert keyed["cuda:0"].preferred == ["mlx5_5"]
    assert keyed["cuda:1"].preferred == ["mlx5_2"]
    assert "cuda:2" not in keyed
    assert keyed["cpu:1"] == h100.nic_preference["cpu:1"]


@pytest.fixture
def visible_5(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    yield


def _context(h100: Topology, master: str = "127.0.0.1:1", **overrides: object) -> NodeContext:
    values = {"cluster.master": master, "cluster.secret": SECRET, **overrides}
    config = load_config(None, env={}, overrides=values).config
    return NodeContext(config, "n-gpu", "127.0.0.1", SECRET.encode(), h100)


@pytest.fixture
def cuda_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees one CUDA device, as a CUDA build on a GPU host would."""
    import torch

    from mooncake.native import cudamap

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    props = SimpleNamespace(total_memory=80 * GIB, uuid="uuid-of-a-device")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: [props][i])
    monkeypatch.setattr(cudamap, "torch_uuids", lambda: ["GPU-uuid-of-a-device"])


def _no_nvml_topology(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> Topology:
    """The DGX H100's sysfs with NVML missing (`how` = "package") or failing ("init")."""
    from mooncake.native import nvml

    machine = load_machine("dgx_h100")
    root = build_sysfs(machine, tmp_path / "sys")
    if how == "package":
        monkeypatch.setattr(nvml, "load_pynvml", lambda: None)
        return detect_topology(root)
    return detect_topology(root, nvml=FakeNvml(machine["gpus"], init_error=NVML_LIB_NOT_FOUND))


@pytest.mark.parametrize("how", ["package", "init"])
def test_a_gpu_without_nvml_is_used_and_said_loudly(
    how: str,
    cuda_seen: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch sees CUDA but NVML reports nothing: the node runs on cuda:0, never silently on
    its CPU, and logs an error naming the package to install and what NVML would add."""
    from mooncake.roles.node.worker import device_for

    ctx = _context(_no_nvml_topology(tmp_path, monkeypatch, how))
    assert ctx.visible_gpus == []
    assert ctx.device_memory_bytes == 80 * GIB  # CUDA's figure, not the host's RAM
    with caplog.at_level(logging.ERROR, logger="mooncake.roles.node.worker"):
        assert device_for(ctx) == "cuda:0"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    text = record.getMessage()
    assert "torch sees 1 CUDA devices but NVML reports no GPU" in text
    assert "pip install nvidia-ml-py" in text and "NUMA node and nearest NICs" in text
    assert ("pynvml not installed" if how == "package" else "Library Not Found") in text


def test_a_gpu_nvml_knows_is_used_quietly(
    h100: Topology, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from mooncake.native import cudamap
    from mooncake.roles.node.worker import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudamap, "torch_uuids", lambda: [h100.gpus[5].uuid])
    ctx = _context(h100)
    with caplog.at_level(logging.WARNING):
        assert device_for(ctx) == "cuda:0"
    assert caplog.records == [] and ctx.gpu("cuda:0") == h100.gpus[5]


def test_no_cuda_is_a_cpu_node(h100: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mooncake.roles.node.worker import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for(_context(h100)) == "cpu"


@pytest.mark.cluster
def test_store_engines_get_the_nic_preference(h100: Topology, visible_5: None) -> None:
    """The node's own tiers (StoreNode) and its Store client are built with the topology's
    NIC preference, keyed by torch's device index; the DRAM arena is on the GPU's node."""
    master = start_master()
    try:
        ctx = _context(h100, master.address.removeprefix("tcp://"), **{"store.dram_bytes": "1MiB"})
        node = mount_local_tiers(ctx)
        assert node is not None
        try:
            assert node.engine.nic_preference["cuda:0"].preferred == ["mlx5_5"]
            assert node.engine.nic_preference["cpu:0"] == h100.nic_preference["cpu:0"]
            # the DRAM arena lives on GPU 5's NUMA node (socket 1), where its NIC is
            assert ctx.arena_location == "cpu:1"
            dram = node.engine.segments.get("n-gpu.dram")
            assert dram is not None and dram.location == "cpu:1"
        finally:
            node.stop()
        # connect_pool reads only the worker's layout and fingerprint
        worker: Any = type("W", (), {"layout": None, "fingerprint": b"f" * 16})()
        store, pool = connect_pool(ctx, worker, None)
        try:
            assert store.engine.nic_preference["cuda:0"].preferred == ["mlx5_5"]
        finally:
            pool.close()
            store.close()
    finally:
        master.stop()
