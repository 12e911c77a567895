"""`[node] instances`: how a node's GPUs, ports, DRAM and SSD are split among its instances
(pure), on a recorded DGX H100 with a fake NVML (8 GPUs)."""

from __future__ import annotations

import pytest

from mooncake.config.load import load_config
from mooncake.config.portrange import PortRange
from mooncake.config.settings import Config, NodeConfig
from mooncake.errors import ConfigError
from mooncake.hw.topology import Topology, detect_topology
from mooncake.native.cudamap import visible_gpus
from mooncake.roles.node.instances import (
    HostShare,
    plan_instances,
    resolve_instances,
    split_gpus,
    split_ports,
)
from mooncake.roles.node.parent import node_tensor_parallel
from tests.fakes.nvml import FakeNvml
from tests.fakes.sysfs import build_sysfs, load_machine

GIB = 1 << 30


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    machine = load_machine("dgx_h100")
    root = build_sysfs(machine, tmp_path_factory.mktemp("h100") / "sys")
    return detect_topology(root, nvml=FakeNvml(machine["gpus"]))


def _uuids(topo: Topology, env: dict[str, str] | None = None) -> list[str]:
    return [g.uuid for g in visible_gpus(topo.gpus, env or {})]


def test_auto_is_one_instance_per_visible_gpu_and_one_on_a_cpu_node(h100: Topology) -> None:
    auto = NodeConfig()
    assert resolve_instances(auto, "decode", len(_uuids(h100))) == 8
    narrowed = _uuids(h100, {"CUDA_VISIBLE_DEVICES": "2,3,4"})
    assert resolve_instances(auto, "prefill", len(narrowed)) == 3
    assert resolve_instances(auto, "decode", 0) == 1  # a CPU node
    assert resolve_instances(NodeConfig(instances="2"), "decode", 8) == 2
    assert resolve_instances(auto, "store", 8) == 1  # auto: master and store run once
    assert resolve_instances(NodeConfig(instances="1"), "master", 8) == 1


def test_auto_gives_each_instance_its_tensor_parallel_degree_of_gpus(h100: Topology) -> None:
    """Automatic instances divide the GPUs by the resolved degree: the setting, or the
    automatic one for the model (a 70B model in bf16 on 80 GB H100s: 4 ranks, 2
    instances; an 8B one: 8); a CPU node runs one whatever the degree."""
    auto = NodeConfig()
    assert resolve_instances(auto, "decode", 8, tensor_parallel=2) == 4
    assert resolve_instances(auto, "decode", 0, tensor_parallel=2) == 1
    assert resolve_instances(NodeConfig(instances="8"), "decode", 8, tensor_parallel=2) == 8
    gpu_bytes = [g.memory_total_bytes for g in visible_gpus(h100.gpus, {})]

    def degree(model: str, setting: int = 0) -> int:
        config = load_config(
            None, {}, {"model.path": model, "model.tensor_parallel": str(setting)}
        ).config
        return node_tensor_parallel(config, gpu_bytes)

    assert (degree("dummy:llama3-70b"), degree("dummy:llama3-8b")) == (4, 1)
    assert degree("dummy:llama3-8b", setting=2) == 2
    assert node_tensor_parallel(Config(), []) == 1


def test_a_store_or_master_asked_for_several_instances_is_refused_naming_the_key() -> None:
    for role in ("store", "master"):
        with pytest.raises(ConfigError, match=f"node.instances = 2: .*a {role} node runs once"):
            resolve_instances(NodeConfig(instances="2"), role, 8)


def test_instances_is_auto_or_an_integer_of_at_least_one(tmp_path) -> None:
    path = tmp_path / "m.toml"
    path.write_text("[node]\ninstances = 4\n")  # a TOML integer, as people write it
    assert load_config(path).config.node.num_instances == 4
    assert load_config(path, overrides={"node.instances": "auto"}).config.node.num_instances is None
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match='node.instances: expected "auto" or an integer >= 1'):
            load_config(path, overrides={"node.instances": bad})


def test_gpus_split_into_equal_consecutive_shares(h100: Topology) -> None:
    """8 GPUs: 8 instances get one each, 2 get four each, in CUDA's order; 3 is refused
    (unequal shares would mean unequal KV caches), naming the counts that divide."""
    ids = _uuids(h100)
    assert split_gpus(ids, 8) == [[u] for u in ids]
    assert split_gpus(ids, 2) == [ids[:4], ids[4:]]
    assert split_gpus(ids, 1) == [ids]
    with pytest.raises(ConfigError, match=r"8 visible GPUs do not split into 3 .* 1, 2, 4, 8"):
        split_gpus(ids, 3)
    with pytest.raises(ConfigError, match="do not split into 16"):
        split_gpus(ids, 16)
    assert split_gpus([], 3) == [[], [], []]  # a CPU node: no GPUs to share


def test_port_range_splits_into_equal_ranges() -> None:
    assert split_ports(PortRange(7000, 7019), 2) == [PortRange(7000, 7009), PortRange(7010, 7019)]
    assert split_ports(PortRange(7000, 7010), 3) == [
        PortRange(7000, 7002),
        PortRange(7003, 7005),
        PortRange(7006, 7008),
    ]
    assert split_ports(PortRange(), 4) == [PortRange()] * 4
    with pytest.raises(ConfigError, match="node.port_range = 7000-7001: 3 instances"):
        split_ports(PortRange(7000, 7001), 3)


def test_plans_give_each_instance_its_id_gpus_ports_and_an_equal_share_of_the_host(
    h100: Topology,
) -> None:
    """A percentage of the host's DRAM and the SSD tier is resolved once and split equally,
    so instances starting together do not each take half of what they find free."""
    cfg = Config(node=NodeConfig(port_range="7000-7019"))  # store.dram_bytes = 50%
    ids = _uuids(h100)
    host = HostShare(dram_free_bytes=100 * GIB, ssd_bytes=40 * GIB, ssd_path="/data/mooncake")
    plans = plan_instances(cfg, "decode", 2, ids, "gpu7", host)
    assert [p.node_id for p in plans] == ["gpu7-0", "gpu7-1"]
    assert [p.cuda_visible_devices for p in plans] == [",".join(ids[:4]), ",".join(ids[4:])]
    assert "node.port_range=7010-7019" in plans[1].sets
    for p in plans:
        assert "node.instances=1" in p.sets
        assert f"store.dram_bytes={25 * GIB}" in p.sets
        assert f"store.ssd_bytes={20 * GIB}" in p.sets
        assert "store.ssd_path=/data/mooncake" in p.sets
        assert not any(s.startswith("decode.kv_cache_bytes") for s in p.sets)  # own GPUs


def test_on_a_cpu_node_a_kv_cache_percentage_of_ram_is_split_too() -> None:
    cfg = load_config(None, overrides={"prefill.kv_cache_bytes": "10%"}).config
    plans = plan_instances(cfg, "prefill", 2, [], "cpu", HostShare(dram_free_bytes=10 * GIB))
    assert [p.cuda_visible_devices for p in plans] == [None, None]  # as the parent's
    for p in plans:
        assert f"prefill.kv_cache_bytes={GIB // 2}" in p.sets
        assert "store.ssd_bytes=0" in p.sets  # no SSD tier found: off for every instance
        assert "node.port_range=" in p.sets
