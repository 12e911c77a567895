"""torch's cuda:N mapped to NVML's GPUs under CUDA_VISIBLE_DEVICES (indices, UUIDs), and
what hangs on it: the NIC preference the node's Transfer Engines get, and the KV cache's
size (from the GPU torch uses, not physical GPU 0). A recorded DGX H100 (GPU i sits beside
NIC mlx5_i) with a fake NVML."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from mooncake.config.load import load_config
from mooncake.config.sizes import Size
from mooncake.hw.topology import Topology, detect_topology
from mooncake.model.info import load_model_info
from mooncake.roles.node.common import NodeContext
from mooncake.roles.node.worker import cache_blocks, connect_pool, mount_local_tiers
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


def test_kv_cache_sized_from_the_visible_gpu(h100: Topology, visible_5: None) -> None:
    """A 50% cache on torch's cuda:0 = GPU 5 (15 GiB free) holds 1.5x what GPU 0's
    10 GiB would have given."""
    ctx = _context(h100)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    info = load_model_info("dummy:tiny")
    blocks = cache_blocks(Size.parse("50%"), ctx, info, "float32", 2, 16, "cuda:0")
    per_block = 2 * 2 * 16 * info.spec.num_kv_heads * info.spec.head_dim * 4
    assert blocks == (15 * GIB // 2) // per_block
    assert ctx.gpu("cuda:0") == h100.gpus[5]


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
